"""`gated-attention quickstart --preset sinks`: does an attention sink form, and does the G1 gate remove it?

The Gated Attention paper ("Gated Attention for Large Language Models: Non-linearity, Sparsity, and Attention-Sink-Free",
Table 4) reports that the sigmoid output gate removes the attention
sink (first-token attention 0.467 -> 0.048) and the massive activations. This
job trains the pair that claim is about on the package corpus
(`training.data.documents("packages", ...)`): an ungated
`GatedAttentionForCausalLM` and the same model with the G1 gate, from the same
initial weights (`common.model_pair`) on the same batches (the step order is a
pure function of the seed), and reports per layer, for both models:

- F-Attn: mean attention on the first token over heads and validation queries q >= 1;
- M-Act: max |hidden| of the layer's output, mean over validation sequences;
- the first token's max |hidden| against the max over every other token;
- gate mean and fraction of gate scores below 0.1;
- validation perplexity.

Every `probe_every` steps both models' per-layer F-Attn and M-Act are probed
on a few validation sequences, which shows the trend with training. A sink
"forms" (the criterion fixed before the sink search, `benchmarks/sink_search.md`) when the ungated model's most sink-like layer reaches
F-Attn >= 0.3; the table prints the uniform-attention value beside it.

Output, in `--out`: `layers.csv` (the printed table), `summary.csv` (one row per
model), `probes.csv`, `training.csv`, `corpus.json` (corpus fingerprint, size,
package versions) and PNGs drawn from those CSVs (`report.draw_sinks`). With
`--architecture hybrid` (or `analyze=True`) both trained models are saved under
`models/` and analysed as `gated-attention analyze` does (`analyze/`, `analyze.csv`).

Index conventions: layers are 1-based (layer l's output is `X[l]`); the first
token is position 0, the BOS token every packed row starts with.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

import numpy as np
import torch

from ..training import data, evaluate_loss
from .common import Data, Job, Trained, model_pair, train_config, train_with_probes
from .report import GATE_FRACTION, columns_of, draw_sinks, format_columns, uniform_first_token_attention, write_csv
from .settings import SinkSettings

SINK_THRESHOLD = 0.3  # F-Attn of the most sink-like layer that counts as a sink (fixed before the search)
MODELS = ("no gate", "G1 gate")


def run(args: argparse.Namespace, s: SinkSettings) -> int:
    """The recipe with settings `s` (`settings.sink_settings_from_args(args)`); `args` give where and how it runs."""
    with Job.start(args, asdict(s)) as job:
        d = prepare_data(s, job)
        models = build_models(s, d, job)
        trained = {name: train_model(model, name, s, d.train, d.valid[: s.probe_sequences], job)
                   for name, model in models.items()}
        layer_rows, summary = measure(models, trained, s, d)
        analyzed = analyze_models(models, d.tokenizer, s, job) if _analyzes(s) else []
        report(layer_rows, summary, trained, analyzed, s, job)
    return 0


# ---------------------------------------------------------------------------------------------
# Data and models


def prepare_data(s: SinkSettings, job: Job) -> Data:
    """Tokenizer, packed training and validation rows; `corpus.json` records which text they are."""
    tokenizer = data.load_tokenizer(s.vocab_size, s.tokenizer_chars, job.cache)
    streams, info = {}, {"corpus": s.corpus}
    for split in ("train", "validation"):
        docs = data.documents(s.corpus, split, s.corpus_chars)
        streams[split] = data.corpus_tokens(tokenizer, split, s.corpus_chars, corpus=s.corpus)
        info[split] = {"fingerprint": data.corpus_fingerprint(docs), "documents": len(docs),
                       "characters": sum(len(d.text) for d in docs), "tokens": int(len(streams[split]))}
    if s.corpus == "packages":
        info.update(data.package_corpus_manifest())
    (job.folder / "corpus.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    bos = tokenizer.bos_token_id
    d = Data(tokenizer, data.pack(streams["train"], s.seq_len, bos),
             data.pack(streams["validation"], s.seq_len, bos, max_rows=max(s.eval_sequences, s.analysis_sequences)))
    job.log(f"data: {s.corpus} corpus {info['train']['fingerprint']}/{info['validation']['fingerprint']}: "
            f"{info['train']['tokens']:,} training tokens ({len(d.train)} rows of {s.seq_len}), "
            f"{info['validation']['tokens']:,} validation tokens; {s.steps} steps x {s.batch_size} rows = "
            f"{s.steps * s.batch_size / max(1, len(d.train)):.2f} epochs")
    return d


def build_models(s: SinkSettings, d: Data, job: Job) -> dict:
    """The pair on the job's device (only the ungated model with `ungated_only`)."""
    ungated, gated = model_pair(s, d.tokenizer, s.architecture, s.hybrid_ratio)
    job.log(f"models: {s.architecture}, {s.num_hidden_layers} layers, width {s.hidden_size}, {s.num_attention_heads} "
            f"heads; {sum(p.numel() for p in ungated.parameters()):,} parameters ungated, "
            f"{sum(p.numel() for p in gated.parameters()):,} with the G1 gate (same initial weights otherwise)")
    models = dict(zip(MODELS, (ungated, gated)))
    if s.ungated_only:
        del models["G1 gate"]
    return {name: model.to(job.placement.device) for name, model in models.items()}


# ---------------------------------------------------------------------------------------------
# Training with probes


def train_model(model, name: str, s: SinkSettings, train_rows, probe_rows, job: Job) -> Trained:
    """Train for `s.steps`, probing per-layer F-Attn and M-Act every `s.probe_every` steps."""

    def probe(step: int, loss: float, minutes: float) -> list[dict]:
        layers = layer_metrics(model, probe_rows)
        job.log(f"{name}: step {step}  {minutes:5.1f} min  loss {loss:.3f}  F-Attn "
                + " ".join(f"{r['f_attn']:.3f}" for r in layers) + "  M-Act " + " ".join(f"{r['m_act']:.1f}" for r in layers))
        return layers

    return train_with_probes(model, name, train_rows, train_config(s, job), job, probe, every=s.probe_every)


# ---------------------------------------------------------------------------------------------
# Measurement


@torch.no_grad()
def layer_metrics(model, rows: torch.Tensor) -> list[dict]:
    """Per decoder layer (1-based): F-Attn, M-Act, first-token and other-token max |hidden|, gate statistics.

    rows: validation sequences `[N, T]`, each starting with BOS. Each value is the
    mean over the N sequences (gate statistics: over all their scores).
    """
    from ..analysis import metrics
    from ..analysis.capture import Capture

    model.eval()
    device = next(model.parameters()).device
    fa, m_act, first, other, gates = [], [], [], [], {}
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        full = cap.layout.attention_layers
        for x in rows:
            cap.clear()
            model(input_ids=x[None].to(device), use_cache=False)
            record = cap.records[-1]
            maps = [record.attentions[f][0].float().cpu().numpy() for f in full]  # [H, T, T] each
            fa.append(metrics.first_token_attention(maps).mean(axis=1))  # [n_attention_layers]
            token_max = metrics.token_max_abs(record.residual_stack()[:, 0].float().cpu().numpy())[1:]  # [L, T]: X[1..L]
            m_act.append(token_max.max(axis=1))
            first.append(token_max[:, 0])
            other.append(token_max[:, 1:].max(axis=1))
            for f, g in record.gates.items():
                gates.setdefault(f, []).append(g.float().cpu().numpy().ravel())
    fa_by_layer = dict(zip(full, np.mean(fa, axis=0)))
    out = []
    for l, (ma, fm, om) in enumerate(zip(np.mean(m_act, axis=0), np.mean(first, axis=0), np.mean(other, axis=0)), 1):
        g = metrics.gate_statistics(np.concatenate(gates[l]) if l in gates else np.zeros(0))
        out.append({
            "layer": l, "f_attn": float(fa_by_layer.get(l, math.nan)), "m_act": float(ma),
            "first_token_max": float(fm), "other_tokens_max": float(om),
            "gate_mean": g["mean"], "gate_frac_below_0.1": g["frac_below_0.1"],
        })
    return out


def measure(models: dict, trained: dict[str, Trained], s: SinkSettings, d: Data) -> tuple[list[dict], list[dict]]:
    """Per-layer rows (the printed table) and one summary row per model, on the validation rows."""
    layer_rows, summary = [], []
    for name, model in models.items():
        history = trained[name].history
        val_ppl = math.exp(evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size))
        layers = layer_metrics(model, d.valid[: s.analysis_sequences])
        layer_rows += [{"model": name, **r, "val_ppl": val_ppl} for r in layers]
        fa = [r["f_attn"] if not math.isnan(r["f_attn"]) else -1.0 for r in layers]  # GDN layers have no F-Attn
        summary.append({
            "model": name, "steps": s.steps, "train_minutes": trained[name].minutes,
            "final_train_loss": history[-1]["loss"], "val_ppl": val_ppl,
            "f_attn_mean": float(np.mean([v for v in fa if v >= 0])),
            "f_attn_max_layer": int(np.argmax(fa)) + 1, "f_attn_max": float(np.max(fa)),
            "m_act": float(np.mean([r["m_act"] for r in layers])),
            "gate_mean": float(np.nanmean([r["gate_mean"] for r in layers])) if name != "no gate" else math.nan,
        })
    return layer_rows, summary


ANALYZE_METRICS = ("f_attn", "m_act", "gate_mean", "sink_spike_alignment", "peak_excess", "inter_spike_retention")


def _analyzes(s: SinkSettings) -> bool:
    """`analyze` runs when asked for, and by default for the hybrid (whose spike/plateau metrics it computes)."""
    return s.analyze if s.analyze is not None else s.architecture == "hybrid"


def analyze_models(models: dict, tokenizer, s: SinkSettings, job: Job) -> list[dict]:
    """Save each trained model to `out/models/<name>` and analyse it as `gated-attention analyze` does.

    Equivalent command: `gated-attention analyze OUT/models/<name> --out OUT/analyze/<name>
    --max-length <seq_len>` (built-in prose/code/math samples, 1000 bootstrap resamples).
    """
    from ..analysis.analyze import run_analysis
    from ..analysis.samples import builtin_samples

    rows = []
    for name, model in models.items():
        slug = name.replace(" ", "_")
        folder = job.folder / "models" / slug
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        metric_rows = run_analysis(model.eval(), tokenizer, builtin_samples(4), job.folder / "analyze" / slug,
                                   model_name=str(folder), max_length=s.seq_len, n_bootstrap=1000, seed=0)
        rows += [{"model": slug, **r} for r in metric_rows]
    return rows


# ---------------------------------------------------------------------------------------------
# Report


TABLE_COLUMNS = [
    *columns_of("model", "layer", "f_attn", "m_act"),
    ("first_token_max", "max|x| tok 0", "{:.1f}"),
    ("other_tokens_max", "max|x| others", "{:.1f}"),
    *columns_of("gate_mean", GATE_FRACTION, "val_ppl"),
]
PROBE_COLUMNS = ["model", "step", "minutes", "loss", "layer", "f_attn", "m_act", "first_token_max",
                 "other_tokens_max", "gate_mean", "gate_frac_below_0.1"]
TRAINING_COLUMNS = ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"]


def format_table(rows: list[dict]) -> str:
    return format_columns(rows, TABLE_COLUMNS)


def report(layer_rows: list[dict], summary: list[dict], trained: dict[str, Trained], analyzed: list[dict],
           s: SinkSettings, job: Job) -> None:
    """Write the CSVs, draw the plots from them, print the table and whether a sink formed."""
    out = job.folder
    write_csv(out / "layers.csv", layer_rows, [k for k, _, _ in TABLE_COLUMNS])
    write_csv(out / "summary.csv", summary, list(summary[0]))
    write_csv(out / "probes.csv", [p for t in trained.values() for p in t.probes], PROBE_COLUMNS)
    write_csv(out / "training.csv", [{"model": name, **h} for name, t in trained.items() for h in t.history],
              TRAINING_COLUMNS)
    plots = draw_sinks(out, SINK_THRESHOLD)
    if analyzed:
        write_csv(out / "analyze.csv", analyzed, list(analyzed[0]))

    uniform = uniform_first_token_attention(s.seq_len)
    base = summary[0]
    formed = base["f_attn_max"] >= SINK_THRESHOLD
    job.log("")
    job.log(format_table(layer_rows))
    job.log("")
    job.log(f"uniform causal attention over {s.seq_len} tokens gives F-Attn {uniform:.3f}. Ungated model: most "
            f"sink-like layer {base['f_attn_max_layer']} at F-Attn {base['f_attn_max']:.3f} -> "
            + (f"a sink formed (>= {SINK_THRESHOLD})" if formed else f"no sink (< {SINK_THRESHOLD})"))
    for r in analyzed:
        if r["metric"] in ANALYZE_METRICS:
            job.log(f"analyze {r['model']:<8} {r['metric']:<22} {r['anchor']:<15} {float(r['mean']):8.4g} "
                    f"[{float(r['ci_low']):.4g}, {float(r['ci_high']):.4g}]  n={r['n']}")
    job.log(f"wrote {job.out / 'layers.csv'}, summary.csv, probes.csv, training.csv, corpus.json, "
            f"{', '.join(p.name for p in plots)} ({job.minutes():.1f} min)")
