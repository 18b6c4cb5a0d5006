"""`gated-attention quickstart --preset backcopy`: a sink that forms without the gate, on a task made for it.

The Bigram-Backcopy task of Guo et al. 2024 ("Active-Dormant Attention Heads:
Mechanistically Demystifying Extreme-Token Phenomena in LLMs", arXiv 2410.13835;
`recipes.backcopy_task`): a bigram chain in which, after a trigger token, the
next token copies the token before the trigger. Attention is needed only at
the trigger queries ("active"); at every other query ("dormant") the bigram of
the current token is all there is to know, and an ungated head that cannot
switch itself off parks its attention on the first token, the BOS every
sequence starts with. The G1 gate (sigmoid on the SDPA output, seed 000) can
close instead, so it needs no sink.

The pair: an ungated `GatedAttentionForCausalLM` ("control") and the same model
with the G1 gate ("gated"), from the same initial weights (`ARMS`, built by `common.model_arms`),
trained on the same pool of sequences in the same order (the batch of step k
depends only on (seed, k)), with the same rates. `--compare-gates` adds, from
the same weights, the gates G1 is compared with (`COMPARED`): "low-rank" (rank
hidden/16), "truncated" (the gate reads the first hidden/16 channels, as
marin's) and "sinks" (GPT-OSS's learned sink logit, no gate). Reported, in `--out`:

- `results.csv`: one row per model: steps, held-out loss (nats per token, on
  `eval_sequences` held-out sequences from another sample seed), the best
  possible loss on them (`optimal_loss`, the task's conditional entropy), and,
  in the layer where the control's dormant-query first-token attention is
  strongest (`sink_layer`): `f_attn_dormant`, `f_attn_active`, `f_attn_all`
  (mean over heads and the queries of that kind), the first token's max
  |hidden| over the other tokens' (`first_token_norm_ratio`, that layer's
  output), `m_act` (mean over layers of max |hidden|), `gate_mean` and
  `sink_dormant` (the attention a learned sink takes at dormant queries);
- `layers.csv` the same per layer, `probes.csv` F-Attn per layer and query kind
  every `probe_every` steps, `training.csv` the loss per step;
- `attention_maps.npz` both models' maps on the first held-out sequence (and its
  tokens), `attention_maps.png` and `sink_trend.png` drawn from those files.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..training import evaluate_loss
from .backcopy_task import BackcopyTask, attention_by_query
from .common import Job, Trained, model_arms, train_config, train_with_probes
from .report import columns_of, draw_backcopy, format_columns, write_csv
from .settings import ARMS as SHARED_ARMS
from .settings import BackcopySettings

SINK_THRESHOLD = 0.3  # the control's dormant-query F-Attn that counts as a sink (fixed before the search)
# The models compared (of `settings.ARMS`). The first is the control (its sink layer is where every model is read);
# each other one is measured against it.
ARMS = {name: SHARED_ARMS[name] for name in ("control", "gated")}
# --compare-gates: the gates G1 is compared with (issue 60), their widths from the settings
COMPARED = {
    "low-rank": lambda s: {"attn_gate": {"position": "G1", "rank": max(1, s.hidden_size // 16)}},
    "truncated": lambda s: {"attn_gate": {"position": "G1", "input_channels": max(1, s.hidden_size // 16)}},
    "sinks": lambda s: {"attn_gate": None, "attention_sinks": True},
}


def run(args: argparse.Namespace, s: BackcopySettings) -> int:
    """The recipe with settings `s` (`settings.backcopy_settings_from_args(args)`); `args` give where and how it runs."""
    with Job.start(args, asdict(s)) as job:
        task, d = prepare_data(s, job)
        models = build_models(s, task, job)
        trained = {name: train_model(model, name, s, task, d, job) for name, model in models.items()}
        results, layer_rows, maps = measure(models, trained, s, task, d)
        report(results, layer_rows, trained, maps, s, task, job)
    return 0


# ---------------------------------------------------------------------------------------------
# Data and models


@dataclass
class Data:
    train: torch.Tensor  # [train_sequences, seq_len]
    valid: torch.Tensor  # [max(eval_sequences, analysis_sequences, probe_sequences), seq_len], held out


def prepare_data(s: BackcopySettings, job: Job) -> tuple[BackcopyTask, Data]:
    task = BackcopyTask(n_tokens=s.n_tokens, n_triggers=s.n_triggers, successors=s.successors,
                        trigger_prob=s.trigger_prob, seed=s.seed)
    n_valid = max(s.eval_sequences, s.analysis_sequences, s.probe_sequences)
    d = Data(task.sample(s.train_sequences, s.seq_len, seed=1), task.sample(n_valid, s.seq_len, seed=2))
    _, active = task.query_kinds(d.valid)
    job.log(f"data: Bigram-Backcopy, {s.n_tokens} tokens ({s.successors} successors each), {s.n_triggers} triggers "
            f"(p {s.trigger_prob:g}), BOS first; {len(d.train)} training sequences of {s.seq_len}, {n_valid} held out "
            f"({active.float().mean().item():.3f} of the queries active); the best possible held-out loss "
            f"{task.optimal_loss(d.valid[: s.eval_sequences]):.4f} nats; "
            f"{s.steps} steps x {s.batch_size} = {s.steps * s.batch_size / len(d.train):.2f} epochs")
    return task, d


def build_models(s: BackcopySettings, task: BackcopyTask, job: Job) -> dict:
    """The `ARMS` on the job's device (only the control with `ungated_only`; `COMPARED` too with `compare_gates`)."""
    arms = {"control": ARMS["control"]} if s.ungated_only else dict(ARMS)
    if s.compare_gates:
        arms |= {name: fields(s) for name, fields in COMPARED.items()}
    models = model_arms(s, task, arms)
    job.log(f"models: {s.num_hidden_layers} layer(s), width {s.hidden_size}, {s.num_attention_heads} head(s), RoPE, "
            "the same initial weights; parameters: "
            + ", ".join(f"{name} {sum(p.numel() for p in m.parameters()):,}" for name, m in models.items()))
    return {name: model.to(job.placement.device) for name, model in models.items()}


# ---------------------------------------------------------------------------------------------
# Training with probes


def train_model(model, name: str, s: BackcopySettings, task: BackcopyTask, d: Data, job: Job) -> Trained:
    """Train for `s.steps`, probing F-Attn per layer and query kind every `s.probe_every` steps (and at step 0)."""
    probe_rows = d.valid[: s.probe_sequences]

    def probe(step: int, loss: float, minutes: float) -> list[dict]:
        layers = attention_by_query(model, task, probe_rows)["layers"]
        job.log(f"{name}: step {step}  loss {loss:.3f}  F-Attn dormant/active per layer "
                + " ".join(f"{r['f_attn_dormant']:.3f}/{r['f_attn_active']:.3f}" for r in layers))
        return layers

    return train_with_probes(model, name, d.train, train_config(s, job), job, probe, every=s.probe_every,
                             at_start=True, lr_min_ratio=s.lr_min_ratio)


# ---------------------------------------------------------------------------------------------
# Measurement


def measure(models: dict, trained: dict[str, Trained], s: BackcopySettings, task: BackcopyTask, d: Data):
    """The results rows (in the control's sink layer), the per-layer rows, and both models' maps on one sequence."""
    per_model = {name: attention_by_query(model, task, d.valid[: s.analysis_sequences]) for name, model in models.items()}
    control_layers = per_model["control"]["layers"]
    sink = max(control_layers, key=lambda r: r["f_attn_dormant"])["layer"]
    results, layer_rows, maps = [], [], {}
    for name, model in models.items():
        m = per_model[name]
        loss = evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size)
        layer_rows += [{"model": name, **r, "m_act": m["m_act"], "gate_mean": m["gate_mean"]} for r in m["layers"]]
        at_sink = next(r for r in m["layers"] if r["layer"] == sink)
        results.append({
            "model": name, "steps": s.steps, "heldout_loss": loss, "optimal_loss": task.optimal_loss(d.valid[: s.eval_sequences]),
            "sink_layer": sink, "f_attn_dormant": at_sink["f_attn_dormant"], "f_attn_active": at_sink["f_attn_active"],
            "f_attn_all": at_sink["f_attn_all"], "m_act": m["m_act"],
            "first_token_norm_ratio": at_sink["first_token_norm_ratio"], "gate_mean": m["gate_mean"],
            "sink_dormant": at_sink["sink_dormant"], "train_minutes": trained[name].minutes,
        })
        maps.update({f"{name}_layer{f}": a for f, a in m["maps"].items()})  # [H, T, T]
    maps["tokens"] = d.valid[0].numpy()
    return results, layer_rows, maps


# ---------------------------------------------------------------------------------------------
# Report


RESULT_COLUMNS = [
    *columns_of("model", "steps"),
    ("heldout_loss", "held-out loss", "{:.4f}"),
    ("optimal_loss", "optimal", "{:.4f}"),
    ("sink_layer", "layer", "{}"),
    ("f_attn_dormant", "F-Attn dormant", "{:.3f}"),
    ("f_attn_active", "F-Attn active", "{:.3f}"),
    ("f_attn_all", "F-Attn all", "{:.3f}"),
    ("m_act", "M-Act", "{:.2f}"),
    ("first_token_norm_ratio", "max|x| tok0/others", "{:.2f}"),
    *columns_of("gate_mean"),
    ("sink_dormant", "sink dormant", "{:.3f}"),
    ("train_minutes", "minutes", "{:.1f}"),
]
LAYER_COLUMNS = ["model", "layer", "f_attn_dormant", "f_attn_active", "f_attn_all", "first_token_norm_ratio", "m_act",
                 "gate_mean", "sink_dormant"]
PROBE_COLUMNS = ["model", "step", "minutes", "loss", "layer", "f_attn_dormant", "f_attn_active", "f_attn_all",
                 "first_token_norm_ratio"]
TRAINING_COLUMNS = ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"]


def report(results, layer_rows, trained: dict[str, Trained], maps: dict, s: BackcopySettings, task: BackcopyTask,
           job: Job) -> None:
    """Write the CSVs and the maps, draw the plots from them, print the table and how it stands against the goal."""
    out = job.folder
    write_csv(out / "results.csv", results, [k for k, _, _ in RESULT_COLUMNS])
    write_csv(out / "layers.csv", layer_rows, LAYER_COLUMNS)
    write_csv(out / "probes.csv", [p for t in trained.values() for p in t.probes], PROBE_COLUMNS)
    write_csv(out / "training.csv", [{"model": n, **h} for n, t in trained.items() for h in t.history], TRAINING_COLUMNS)
    np.savez_compressed(out / "attention_maps.npz", **maps)
    plots = draw_backcopy(out, SINK_THRESHOLD, task.n_tokens)

    job.log("")
    job.log(format_columns(results, RESULT_COLUMNS))
    job.log("")
    control = results[0]
    formed = control["f_attn_dormant"] >= SINK_THRESHOLD
    line = (f"control: F-Attn at dormant queries {control['f_attn_dormant']:.3f} in layer {control['sink_layer']} -> "
            + (f"a sink formed (>= {SINK_THRESHOLD})" if formed else f"no sink (< {SINK_THRESHOLD})"))
    for other in results[1:]:
        halved = other["f_attn_dormant"] <= control["f_attn_dormant"] / 2
        kept = other["heldout_loss"] <= control["heldout_loss"] + 0.01
        line += (f"; {other['model']} {other['f_attn_dormant']:.3f} ({'at most' if halved else 'more than'} half of "
                 f"it), held-out loss {other['heldout_loss']:.4f} against {control['heldout_loss']:.4f} "
                 f"({'within' if kept else 'worse than'} +0.01)")
    job.log(line)
    job.log(f"wrote {job.out / 'results.csv'}, layers.csv, probes.csv, training.csv, attention_maps.npz, "
            f"{', '.join(p.name for p in plots)} ({job.minutes():.1f} min)")
