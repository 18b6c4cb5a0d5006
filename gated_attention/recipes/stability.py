"""`gated-attention quickstart --preset stability`: does the G1 gate let a model train at larger learning rates?

The Gated Attention paper (seed 000) reports that the sigmoid output gate "nearly eliminates loss spikes" and
"supports larger learning rates": with the maximum rate raised, its baselines fail to converge and the gated
models train. It credits the gate's smaller massive activations, which leave bf16 training less exposed to
rounding. Wortsman et al. 2023 (*Small-scale proxies for large-scale Transformer training instabilities*) show
that such instabilities appear in small models too when the learning rate is swept high enough, and summarise a
sweep by its learning-rate sensitivity; qk-layernorm is their known mitigation of attention-logit growth.

The sweep: every arm of `settings.STABILITY_ARMS` (the ungated `control`, its G1 twin `gated`, the control with
Qwen3's q/k RMSNorm `qk_norm`) is trained from the same initial weights (`common.model_arms`) at every peak rate
of `lrs`, on the embedded corpus, with the same batches in the same order (a function of (seed, step)), the same
steps and the same schedule (linear warmup, cosine decay), under bf16 autocast with `dtype` "bfloat16". The
gates train at the same rate as everything else.

Per run (`--out/results.csv`, one row per arm and rate):
- `final_loss`: held-out loss (nats per token, `eval_sequences` rows of the validation split) after the last step;
- `best_loss`: the lowest held-out loss of the run, measured every `eval_every` steps and at the end;
- `diverged`: the training loss became NaN or inf (the run stops there), or the final held-out loss is not below
  the arm's loss before training (`initial_loss`);
- `max_spike`: the largest rise of the smoothed training loss (an EMA, `smoothing`) over its running minimum;
- at the end, on `analysis_sequences` held-out rows: `max_attn_logit`, the largest |q.k| x scale over the causal
  positions of every layer and head (what the softmax sees; Wortsman's attention-logit growth),
  `max_output_logit`, the largest |logit| of the LM head (their output-logit divergence), and `m_act`, the mean
  over layers of the largest |hidden| (the analysis toolkit's M-Act).

`sensitivity.csv`: per arm, the learning-rate sensitivity of Wortsman et al.: the mean over the sweep of
min(final_loss, initial_loss) minus the smallest of those values, a diverged run counting as initial_loss
(`lr_sensitivity`). `training.csv` and `probes.csv` hold the training loss per step and the held-out losses;
`lr_sweep.png` (final loss against the rate) and `loss_at_highest_lr.png` are drawn from the files.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from ..training import data, evaluate_loss
from .common import Data, Job, model_arms, train_config, train_with_probes
from .report import draw_stability, format_columns, stability_goal_lines, write_csv
from .settings import STABILITY_ARMS, StabilitySettings


def run(args: argparse.Namespace, s: StabilitySettings) -> int:
    """The recipe with settings `s` (`settings.stability_settings_from_args(args)`)."""
    with Job.start(args, asdict(s), dtype=s.dtype) as job:
        d = prepare_data(s, job)
        initial, initial_loss = build_models(s, d, job)
        rows, history, probes = sweep(initial, initial_loss, s, d, job)
        report(rows, history, probes, initial_loss, s, job)
    return 0


# ---------------------------------------------------------------------------------------------
# Data and models


def prepare_data(s: StabilitySettings, job: Job) -> Data:
    tokenizer = data.load_tokenizer(s.vocab_size, s.max_chars, job.cache)
    bos = tokenizer.bos_token_id
    train_rows = data.pack(data.corpus_tokens(tokenizer, "train", s.max_chars), s.seq_len, bos)
    valid = data.pack(data.corpus_tokens(tokenizer, "validation", s.max_chars), s.seq_len, bos,
                      max_rows=max(s.eval_sequences, s.analysis_sequences))
    job.log(f"data: embedded corpus, BPE vocabulary {s.vocab_size}; {train_rows.numel():,} training tokens in "
            f"{len(train_rows)} rows of {s.seq_len}, {len(valid)} held-out rows; {s.steps} steps x {s.batch_size} rows "
            f"= {s.steps * s.batch_size / len(train_rows):.2f} epochs at each of {len(s.lrs)} rates for "
            f"{len(s.arms)} arms")
    return Data(tokenizer, train_rows, valid)


def build_models(s: StabilitySettings, d: Data, job: Job) -> tuple[dict[str, nn.Module], dict[str, float]]:
    """Every arm's initial model (copied for each rate) on the job's device, and its held-out loss before training."""
    models = model_arms(s, d.tokenizer, {name: STABILITY_ARMS[name] for name in s.arms})
    models = {name: model.to(job.placement.device) for name, model in models.items()}
    initial_loss = {name: evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size) for name, model in models.items()}
    job.log(f"models: {s.num_hidden_layers} layers, width {s.hidden_size}, {s.num_attention_heads} heads, the same "
            "initial weights; " + ", ".join(f"{name} {sum(p.numel() for p in m.parameters()):,} parameters, held-out "
                                            f"loss {initial_loss[name]:.4f} before training" for name, m in models.items()))
    return models, initial_loss


# ---------------------------------------------------------------------------------------------
# The sweep


def sweep(initial: dict[str, nn.Module], initial_loss: dict[str, float], s: StabilitySettings, d: Data, job: Job):
    """Train a copy of every arm's initial model at every rate (rates in the outer loop, so that the table fills
    rate by rate); returns the results rows, the training records and the held-out probes."""
    from tqdm.auto import tqdm

    rows, history, probes = [], [], []
    with tqdm(total=len(s.lrs) * len(initial), desc="sweep", unit="run", disable=not job.progress,
              dynamic_ncols=True) as bar:
        for lr in s.lrs:
            for name, start in initial.items():
                model = copy.deepcopy(start)
                row, trained = train_and_measure(model, name, lr, initial_loss[name], s, d, job)
                rows.append(row)
                history += [{**h, "model": name, "lr": lr, "step_lr": h["lr"]} for h in trained.history]
                probes += [{**p, "model": name, "lr": lr} for p in trained.probes]
                del model
                bar.update(1)
    return rows, history, probes


def train_and_measure(model: nn.Module, name: str, lr: float, initial_loss: float, s: StabilitySettings, d: Data,
                      job: Job):
    """One run: `s.steps` steps at peak rate `lr` (gates too), the held-out loss every `s.eval_every` steps; a loss
    that is not finite ends it. Returns its results row and the `common.Trained` record."""
    config = train_config(s, job, lr=lr, gate_lr=lr, max_grad_norm=s.max_grad_norm)

    def probe(step: int, loss: float, minutes: float) -> list[dict]:
        return [{"heldout_loss": evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size)}]

    trained = train_with_probes(model, f"{name} lr {lr:g}", d.train, config, job, probe, every=s.eval_every,
                                lr_min_ratio=s.lr_min_ratio, stop_at_divergence=True)
    heldout = [p["heldout_loss"] for p in trained.probes if math.isfinite(p["heldout_loss"])]
    if trained.diverged_at is None:
        final = trained.probes[-1]["heldout_loss"]  # the probe at the last step
    else:
        final = evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size)  # what the diverged model gives
    losses = [h["loss"] for h in trained.history]
    row = {
        "model": name, "lr": lr, "final_loss": final, "best_loss": min(heldout, default=math.nan),
        "diverged": trained.diverged_at is not None or not final < initial_loss,  # NaN is not below anything
        "max_spike": max_spike(losses, s.smoothing), **logit_metrics(model, d.valid[: s.analysis_sequences]),
    }
    where = f"diverged at step {trained.diverged_at}" if trained.diverged_at else f"{s.steps} steps"
    job.log(f"{name} lr {lr:g}: {where}, held-out {final:.4f} (best {row['best_loss']:.4f}, before training "
            f"{initial_loss:.4f}{'; diverged' if row['diverged'] else ''}), largest spike {row['max_spike']:.3f}, "
            f"attention logit {row['max_attn_logit']:.4g}, output logit {row['max_output_logit']:.4g}, "
            f"M-Act {row['m_act']:.4g} ({trained.minutes:.1f} min)")
    return row, trained


# ---------------------------------------------------------------------------------------------
# Measurement


def max_spike(losses: list[float], smoothing: float) -> float:
    """The largest rise of the EMA of `losses` (weight `smoothing` on the past; it starts at the first loss) over
    its running minimum; 0 for a loss that never rises, NaN for no loss. Only the finite prefix is read (a
    diverged run's last, non-finite loss is not in its history)."""
    ema, low, spike = math.nan, math.inf, math.nan
    for loss in losses:
        if not math.isfinite(loss):
            break
        ema = loss if math.isnan(ema) else smoothing * ema + (1 - smoothing) * loss
        low = min(low, ema)
        spike = max(0.0 if math.isnan(spike) else spike, ema - low)
    return spike


def capped_loss(final_loss: float, initial_loss: float) -> float:
    """A run's final loss as the sweep reads it: at most the arm's loss before training, and that loss where the run
    diverged (its final loss is not finite)."""
    return min(final_loss, initial_loss) if math.isfinite(final_loss) else initial_loss


def lr_sensitivity(final_losses: list[float], initial_loss: float) -> float:
    """Wortsman et al. 2023: the mean over the sweep of the capped final losses (`capped_loss`) minus the smallest.
    NaN where no rate trains (every run ends at or above the initial loss): the spread is 0 there, which would read
    as "every rate ends as well as the best"."""
    capped = [capped_loss(loss, initial_loss) for loss in final_losses]
    if min(capped) >= initial_loss:
        return math.nan
    return float(np.mean(capped) - min(capped))


LOGIT_PROBE = "stability_logit_probe"  # the attention implementation that records the logits (`attention_logits`)
_LARGEST: list[float] = []  # while `attention_logits` is open: the largest |logit| of each attention call


def _logit_probe_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, after recording the largest |q.k| x scale over the causal (and unmasked)
    positions: query `[B, HQ, T, D]`, key `[B, HKV, S, D]` as the model hands them over (after RoPE and q/k norm)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # [B, HQ, S, D]: GQA groups share a kv head
    logits = (query.float() @ k.float().transpose(-1, -2)) * kwargs["scaling"]  # [B, HQ, T, S]
    T, S = logits.shape[-2:]
    allowed = torch.ones(T, S, dtype=torch.bool, device=logits.device).tril(S - T)  # query t sees keys <= t + S - T
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        allowed = allowed & attention_mask
    _LARGEST.append(float(logits.abs().masked_fill(~allowed, 0).max()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def attention_logits(model: nn.Module) -> Iterator[list[float]]:
    """While open, `model` attends through `_logit_probe_forward` (transformers' SDPA, the same numbers) and the
    yielded list fills with the largest |attention logit| of every attention call; the implementation is
    restored on exit. Registered with transformers' attention interfaces, so the model's own attention module
    hands over its q and k: nothing of its arithmetic is redone here but the logits themselves."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(LOGIT_PROBE, _logit_probe_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(LOGIT_PROBE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    before = model.config._attn_implementation
    model.set_attn_implementation(LOGIT_PROBE)
    _LARGEST.clear()
    try:
        yield _LARGEST
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def logit_metrics(model: nn.Module, rows: torch.Tensor) -> dict[str, float]:
    """`max_attn_logit`, `max_output_logit` and `m_act` of `model` on held-out `rows` `[N, T]`, in fp32."""
    from ..analysis import metrics
    from ..analysis.capture import Capture

    model.eval()
    device = next(model.parameters()).device
    output, m_act = [], []
    with attention_logits(model) as largest, Capture(model, residual=True, attentions=False, gates=False) as cap:
        for x in rows:
            cap.clear()
            logits = model(input_ids=x[None].to(device), use_cache=False).logits  # [1, T, V]
            output.append(float(logits.float().abs().max()))
            m_act.append(metrics.m_act(cap.records[-1].residual_stack()[:, 0].float().cpu().numpy()))  # [L+1, T, D]
        attention = float(np.max(largest)) if largest else math.nan  # NaN weights: NaN, whatever the order
    return {"max_attn_logit": attention, "max_output_logit": float(np.max(output)), "m_act": float(np.mean(m_act))}


# ---------------------------------------------------------------------------------------------
# Report


RESULT_COLUMNS = ["model", "lr", "final_loss", "best_loss", "diverged", "max_spike", "max_attn_logit",
                  "max_output_logit", "m_act"]
SENSITIVITY_COLUMNS = ["model", "lr_sensitivity", "initial_loss"]
SENSITIVITY_RULE = (
    "lr_sensitivity (Wortsman et al. 2023): the mean over the swept learning rates of min(final_loss, initial_loss) "
    "minus the smallest of those values, one arm at a time; a diverged run whose final_loss is not finite counts as "
    "initial_loss, the arm's held-out loss before training. final_loss is results.csv's. 0: every rate ends as well "
    "as the best; initial_loss - best: none trains at all but the best; nan: no rate trains at all."
)
TRAINING_COLUMNS = ["model", "lr", "step", "loss", "step_lr", "gate_score", "batch", "seconds"]
PROBE_COLUMNS = ["model", "lr", "step", "minutes", "loss", "heldout_loss"]
TABLE = [
    ("model", "model", "{}"), ("lr", "lr", "{:g}"), ("final_loss", "final", "{:.4f}"), ("best_loss", "best", "{:.4f}"),
    ("diverged", "diverged", "{}"), ("max_spike", "max spike", "{:.3f}"), ("max_attn_logit", "attn logit", "{:.4g}"),
    ("max_output_logit", "output logit", "{:.4g}"), ("m_act", "M-Act", "{:.4g}"),
]


def sensitivities(rows: list[dict], initial_loss: dict[str, float]) -> list[dict]:
    return [{"model": name, "lr_sensitivity": lr_sensitivity([r["final_loss"] for r in rows if r["model"] == name], loss),
             "initial_loss": loss} for name, loss in initial_loss.items()]


# The goal, gated against control (the issue's): a sensitivity at most `HALF` the control's, and at the highest rate
# where the control fails (diverges, or ends at least `FAILED` above its best) the gated model ends within `HELD` of
# its own best.
HALF, FAILED, HELD = 0.5, 0.5, 0.1
# "Best" is read two ways, both reported: the arm's best capped final loss over the sweep (the rate it trains best
# at), and the run's own lowest held-out loss (a spike it did not recover from).
READINGS = ("sweep", "run")


@dataclass
class Failure:
    """At the highest rate where the control fails against one reading of "best": both arms' figures there."""

    reading: str  # one of READINGS
    lr: float | None  # None: the control failed at no rate (the sweep does not reach its failure)
    control: dict | None = None  # the control's results row there
    control_best: float = math.nan
    gated: dict | None = None
    gated_best: float = math.nan

    @property
    def held(self) -> bool:
        """The gated model did not diverge and ended within `HELD` of its best (1e-9: the decimal 0.1 itself counts)."""
        return self.gated is not None and not self.gated["diverged"] and self.gated_excess <= HELD + 1e-9

    @property
    def gated_excess(self) -> float:
        return self.gated["final_loss"] - self.gated_best if self.gated is not None else math.nan


@dataclass
class Verdict:
    """The figures the goal is judged on (`verdict`); `report.stability_goal_lines` writes them out."""

    sensitivity: dict[str, float]  # arm -> lr_sensitivity
    ratio: float | None = None  # gated / control sensitivity; None without a gated arm or where the control's is 0 or NaN
    failures: list[Failure] = field(default_factory=list)  # one per reading, with a gated arm

    @property
    def halved(self) -> bool:
        return self.ratio is not None and self.ratio <= HALF


def verdict(rows: list[dict], sensitivity: list[dict]) -> Verdict:
    """Judge the goal (see `HALF`, `FAILED`, `HELD`) on the results rows and the arms' sensitivities."""
    sens = {r["model"]: r["lr_sensitivity"] for r in sensitivity}
    v = Verdict(sens)
    if "gated" not in sens:
        return v
    if sens["control"] > 0:
        v.ratio = sens["gated"] / sens["control"]
    by = {(r["model"], r["lr"]): r for r in rows}
    initial = {r["model"]: r["initial_loss"] for r in sensitivity}
    sweep_best = {m: min(capped_loss(r["final_loss"], initial[m]) for r in rows if r["model"] == m)
                  for m in ("control", "gated")}
    for reading in READINGS:
        best = (lambda r: sweep_best[r["model"]]) if reading == "sweep" else (lambda r: r["best_loss"])
        failed = [r["lr"] for r in rows
                  if r["model"] == "control" and (r["diverged"] or r["final_loss"] - best(r) >= FAILED)]
        if not failed:
            v.failures.append(Failure(reading, None))
            continue
        lr = max(failed)
        c, g = by[("control", lr)], by[("gated", lr)]
        v.failures.append(Failure(reading, lr, c, best(c), g, best(g)))
    return v


def report(rows: list[dict], history: list[dict], probes: list[dict], initial_loss: dict[str, float],
           s: StabilitySettings, job: Job) -> None:
    """Write the CSVs, draw the plots from them, print the table, the sensitivities and the goal."""
    out = job.folder
    write_csv(out / "results.csv", rows, RESULT_COLUMNS)
    sensitivity = sensitivities(rows, initial_loss)
    write_csv(out / "sensitivity.csv", sensitivity, SENSITIVITY_COLUMNS, comment=SENSITIVITY_RULE)
    write_csv(out / "training.csv", history, TRAINING_COLUMNS)
    write_csv(out / "probes.csv", probes, PROBE_COLUMNS)
    plots = draw_stability(out)

    job.log("")
    job.log(format_columns(rows, TABLE))
    job.log("")
    for line in stability_goal_lines(verdict(rows, sensitivity)):
        job.log(line)
    job.log(f"wrote {job.out / 'results.csv'}, sensitivity.csv, training.csv, probes.csv, "
            f"{', '.join(p.name for p in plots)} ({job.minutes():.1f} min)")
