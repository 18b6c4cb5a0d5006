"""What the recipes share: where they run (`Placement`), the run itself (`Job`), the model pairs, and training
with probes between chunks (`train_with_probes`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import CLIError
from ..training import TrainConfig, data, is_gate_parameter, make_optimizer, make_scheduler, train
from ..training.threads import set_cpu_threads
from .folders import SETTINGS, staged_out
from .settings import ARMS

# ---------------------------------------------------------------------------------------------
# Device


@dataclass(frozen=True)
class Placement:
    """Where the job runs: parameters are fp32 everywhere; on a GPU the training forwards run under bf16 autocast.

    Evaluation always runs in fp32, so every column of the table measures the same fp32 model on any device.
    """

    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32

    def describe(self) -> str:
        if self.autocast_dtype is None:
            return f"{self.device.type} (fp32)"
        return (f"{self.device.type} (training under {dtype_name(self.autocast_dtype)} autocast, fp32 parameters; "
                "fp32 evaluation)")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def choose_device(requested: str, dtype: str | None = None) -> Placement:
    """`--device auto|cpu|cuda`: auto is cuda when torch sees a GPU; cuda trains under bf16 autocast. A recipe
    that chooses its training precision itself (`dtype`: "float32" or "bfloat16") gets it on either device."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in ("cpu", "cuda"):
        raise CLIError(f"--device {requested!r}: choose auto, cpu or cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False); use --device cpu")
    if dtype is None:
        autocast = torch.bfloat16 if requested == "cuda" else None
    else:
        autocast = {"float32": None, "bfloat16": torch.bfloat16}[dtype]
    return Placement(torch.device(requested), autocast)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Job:
    """One recipe run: its output folder, the folder it writes into until it is done, cache, placement, progress
    bars, log and clock."""

    out: Path  # --out: where the finished run appears (and what the log names)
    folder: Path  # where the run writes: a staging folder beside `out`, renamed to it when the run is done
    cache: Path
    placement: Placement
    progress: bool
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    @contextlib.contextmanager
    def start(cls, args: argparse.Namespace, settings: dict, dtype: str | None = None) -> Iterator[Job]:
        """Read the run's flags (`--out`, `--cache`, `--device`, `--threads`, `--no-progress`) and yield the job,
        its `settings.json` (the recipe's settings and where it ran) written. What the run writes appears at
        `--out` when the block ends, whole, replacing an earlier run's output; a run that fails or is stopped
        leaves `--out` as it was (`folders.staged_out`). `dtype`: the recipe's own training precision
        (`choose_device`)."""
        placement = choose_device(getattr(args, "device", None) or "auto", dtype)
        cache = Path(args.cache).expanduser() if getattr(args, "cache", None) else data.cache_dir()
        with staged_out(args) as folder:
            job = cls(Path(args.out).expanduser(), folder, cache, placement, progress=not getattr(args, "no_progress", False))
            # On a GPU torch's CPU threads do little; there only an explicit --threads changes them.
            threads = ""
            if placement.device.type == "cpu" or getattr(args, "threads", None):
                count, why = set_cpu_threads(getattr(args, "threads", None))
                threads = f"; {count} torch thread(s) ({why})"
            where = {"device": placement.device.type, "autocast": dtype_name(placement.autocast_dtype),
                     "threads": torch.get_num_threads()}
            (folder / SETTINGS).write_text(json.dumps({**settings, **where}, indent=1), encoding="utf-8")
            job.log(f"device: {placement.describe()}{threads}")
            yield job

    def log(self, message: str) -> None:
        # Above any open progress bar (tqdm clears and redraws it); flushed: a background run's log is read while it runs
        tqdm.write(message)
        sys.stdout.flush()

    def minutes(self) -> float:
        return (time.perf_counter() - self.started) / 60


# ---------------------------------------------------------------------------------------------
# Data and models


@dataclass
class Data:
    """A recipe's rows of its corpus: the tokenizer, packed training rows and held-out rows."""

    tokenizer: object
    train: torch.Tensor  # [N, seq_len]
    valid: torch.Tensor  # [M, seq_len], held out (M: the recipe's evaluation and analysis rows)
    valid_long: torch.Tensor | None = None  # [<= M, long_factor * seq_len]: quickstart's long-context rows


def model_shape(s, tokenizer) -> dict:
    """Config fields shared by every model of a recipe (`s`: `Settings` or `SinkSettings`): Llama's names."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads, max_position_embeddings=s.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def model_arms(s, tokenizer, arms: dict[str, dict], architecture: str = "dense", hybrid_ratio: int = 3) -> dict:
    """One model per arm, `{name: config fields}` (e.g. `{"attn_gate": {"position": "G1"}}`), from the same
    initial weights: every arm gets the first arm's weights, and only the modules an arm adds (gates, q/k norms)
    start from their own initialisation (seeded by `s.seed`, so they too are the same in every run).

    Dense: `GatedAttentionForCausalLM`. Hybrid: `GatedDeltaNetHybridForCausalLM`
    at the massive-activations paper's `hybrid_ratio`:1 (every `hybrid_ratio`-th layer full
    attention), the GDN layers as wide as the attention (`num_attention_heads`
    heads of `head_dim` keys and `2 * head_dim` values); only the
    full-attention layers differ.
    """
    shape = model_shape(s, tokenizer)
    if architecture == "dense":
        from ..configuration.gated_attention import GatedAttentionConfig as Config
        from ..modeling.gated_attention import GatedAttentionForCausalLM as Model
    else:
        from ..configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig as Config
        from ..modeling.gated_deltanet_hybrid import GatedDeltaNetHybridForCausalLM as Model

        head_dim = s.hidden_size // s.num_attention_heads
        shape.update(hybrid_ratio=hybrid_ratio, linear_num_key_heads=s.num_attention_heads,
                     linear_key_head_dim=head_dim, linear_value_head_dim=2 * head_dim)
    models = {}
    for name, fields in arms.items():
        torch.manual_seed(s.seed)
        model = Model(Config(**{**shape, **fields}))
        if models:  # the first arm's weights; an arm may add modules, never drop or reshape one
            first = next(iter(models.values())).state_dict()
            missing, unexpected = model.load_state_dict(first, strict=False)
            assert not unexpected and not set(missing) & set(first), (name, missing, unexpected)
        models[name] = model
    return models


def model_pair(s, tokenizer, architecture: str = "dense", hybrid_ratio: int = 3):
    """An ungated model and the same model with the G1 gate: identical weights apart from the gates
    (`model_arms`)."""
    models = model_arms(s, tokenizer, {name: ARMS[name] for name in ("control", "gated")}, architecture, hybrid_ratio)
    return models["control"], models["gated"]


# ---------------------------------------------------------------------------------------------
# Training with probes


@dataclass
class Trained:
    history: list[dict]  # one record per step (`training.train`)
    probes: list[dict]  # the probe's rows, each with model, step, minutes and the last training loss
    minutes: float
    diverged_at: int | None = None  # the step whose loss was not finite (`stop_at_divergence`); None: none was


# (step, the last training loss (NaN before the first step), minutes since training began) -> the probe's rows
Probe = Callable[[int, float, float], list[dict]]


def train_config(s, job: Job, **fields) -> TrainConfig:
    """The `TrainConfig` of a recipe's settings `s` (steps, batch_size, seed, warmup_fraction, and lr, gate_lr and
    weight_decay where it has one) on the job's placement; `fields` set others (a sweep's rate, a run's steps,
    from which the warmup is counted)."""
    own = {name: getattr(s, name) for name in ("lr", "gate_lr", "weight_decay") if hasattr(s, name)}
    steps = fields.get("steps", s.steps)
    return TrainConfig(**{**own, "steps": steps, "batch_size": s.batch_size, "seed": s.seed,
                          "warmup_steps": max(1, int(s.warmup_fraction * steps)),
                          "autocast_dtype": job.placement.autocast_dtype, **fields})


def train_with_probes(model, name: str, rows, config: TrainConfig, job: Job, probe: Probe, *, every: int,
                      at_start: bool = False, gates_first: int = 0, lr_min_ratio: float = 0.1,
                      stop_at_divergence: bool = False) -> Trained:
    """Train `model` on `rows` for `config.steps`, calling `probe` every `every` steps (0: only at the end), at
    the last step, and with `at_start` before the first.

    Training runs in chunks between probes with one optimizer and one scheduler (warmup, then cosine decay to
    `lr_min_ratio` of the peak); the batch of step k depends only on (seed, k), so chunking changes nothing.
    For the first `gates_first` steps only the gate parameters train (the others frozen, their learning rate
    unused): that step is a chunk boundary too, without a probe unless one falls there. A loss that is not
    finite raises `FloatingPointError` (`training.train`); with `stop_at_divergence` it ends the run instead,
    its step in `diverged_at`, no probe after it (a learning-rate sweep expects some runs to diverge).
    """
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps, lr_min_ratio)
    every = every or config.steps
    stops = sorted({*range(every, config.steps, every), config.steps, *([gates_first] if gates_first else [])})
    history, probes, t0, start = [], [], time.perf_counter(), 0

    def take(step: int) -> None:
        loss = history[-1]["loss"] if history else math.nan
        minutes = (time.perf_counter() - t0) / 60
        probes.extend({"model": name, "step": step, "minutes": minutes, "loss": loss, **r}
                      for r in probe(step, loss, minutes))

    # One bar for the whole run, which every chunk advances; the probes' lines are written above it (`Job.log`).
    with tqdm(total=config.steps, desc=name, disable=not job.progress, dynamic_ncols=True, leave=False) as bar:
        if at_start:
            take(0)
        for stop in stops:
            alone = start < gates_first
            for n, p in model.named_parameters():
                p.requires_grad_(not alone or is_gate_parameter(n))  # a frozen parameter gets no gradient: AdamW skips it
            bar.set_description(f"{name}{' (gates alone)' if alone else ''}", refresh=False)
            try:
                train(model, rows, replace(config, steps=stop), optimizer, scheduler, start_step=start,
                      on_step=lambda step, record: history.append(record), bar=bar)
            except FloatingPointError:
                if not stop_at_divergence:
                    raise
                diverged_at = len(history) + 1  # `train` raises before it records the step
                break
            start = stop
            if stop % every == 0 or stop == config.steps:
                take(stop)
        else:
            diverged_at = None
    for p in model.parameters():
        p.requires_grad_(True)
    return Trained(history, probes, (time.perf_counter() - t0) / 60, diverged_at)
