"""`run_analysis`: capture every input, reduce it to metrics, write arrays, tables, plots and a summary.

Files written to `out_dir` (summary.md last, so a folder without it is an interrupted run):

- `arrays.npz`: per-input trajectories `m_first`, `m_sink`, `m_act_layers` `[N, L+1]`,
  `first_token_attention` `[N, n_attn, H]` (n_attn: one row per attention block, `attention_rows`),
  `consensus_sink`, gate histograms and per-head gate stats.
- `inputs.csv`, `layers.csv`, `peak_excess.csv`, `gates.csv`, `metrics.csv`
  (metric, anchor, mean and 95% bootstrap CI over inputs), `intervention.csv`.
- `trajectory.png`, `first_token_attention.png`, `gate_hist.png` (drawn from the files above).
- `summary.md`.

Layers are decoder-layer calls (`ModelLayout.layers`): in a model that runs some layers several times in one
forward, each pass is its own row of every per-layer array and of `layers.csv` (`name`: the module's path,
`pass`: its k-th call), its F-Attn read from that call's map and its M-Act from that call's output, as
transformers' `output_attentions` / `output_hidden_states` return one per call. A layer that holds several
attention blocks (Longcat-Flash) has a row for each later block after its own, named by the block's module, with
its F-Attn and no residual columns: the model returns no state between its blocks.

Two anchors: `first_token` (token 0, the massive-activations paper's figures) and `consensus_sink`
(the input's consensus sink, that paper's quantitative metrics).
"""

from __future__ import annotations

import csv
import inspect
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import GatedAttentionWarning
from . import metrics as M
from .capture import Capture, Record
from .layout import ModelLayout, input_device, model_layout
from .interventions import intervene
from .samples import Sample

ANCHORS = ("consensus_sink", "first_token")
# Metrics read from attention maps or anchored at the consensus sink: left out for a model without softmax attention.
SINK_METRICS = ("f_attn", "sink_spike_alignment", "peak_excess", "inter_spike_retention", "inter_spike_activation",
                "random_layer_baseline")


@dataclass
class InputResult:
    sample: Sample
    n_tokens: int
    consensus_sink: int  # -1 when the model has no softmax attention
    m_first: np.ndarray  # [L+1]
    m_sink: np.ndarray  # [L+1], NaN when there is no consensus sink
    m_act_layers: np.ndarray  # [L+1]
    first_token_attention: np.ndarray  # [n_attn, H]
    gate: dict[str, float]  # "mean", "frac_below_0.1", "frac_below_0.5" over this input's scores (NaN: no gates)


class GateAccumulator:
    """Per-layer `metrics.gate_summary` sums, accumulated over inputs."""

    def __init__(self):
        self.layers: dict[int, dict[str, np.ndarray]] = {}

    def add(self, f: int, summary: dict[str, np.ndarray]) -> None:
        acc = self.layers.setdefault(f, {key: np.zeros_like(value) for key, value in summary.items()})
        for key, value in summary.items():
            acc[key] += value

    def per_head(self, f: int) -> dict[str, np.ndarray]:
        """Layer f's `mean` and `frac_below_<t>` per head, `[H]` each."""
        acc = self.layers[f]
        return {"mean": acc["sum"] / acc["n"], **{f"frac_below_{t:g}": acc[f"below_{t:g}"] / acc["n"] for t in M.GATE_THRESHOLDS}}

    def table(self) -> list[dict]:
        rows = []
        for f in sorted(self.layers):
            stats, n = self.per_head(f), self.layers[f]["n"]
            for h in range(len(n)):
                rows.append({"layer": f, "head": h, "n_scores": int(n[h]), **{key: value[h] for key, value in stats.items()}})
        return rows


def reduce_record(record: Record, layout: ModelLayout, b: int = 0) -> tuple[np.ndarray, int, np.ndarray]:
    """Input b of a reduced Record -> (token max |X| `[L+1, T]`, consensus sink, first-token attention `[n_attn, H]`).

    n_attn counts attention blocks (`layout.attention_rows`: a layer with two has two rows), and the consensus sink
    averages over all of them. Blocks with fewer heads than others (Inkling2's full and sliding layers differ) are
    NaN-padded to the most."""
    token_max = torch.stack([x[b].cpu() for x in record.token_max]).numpy()  # the layers may sit on several devices
    rows = layout.attention_rows
    sink = M.consensus_sink_of(record.block("received", f, k)[b].cpu().numpy() for f, k in rows)
    first = [record.block("first_token_attention", f, k)[b].cpu().numpy()[None] for f, k in rows]
    return token_max, sink, _pad_heads(first)[:, 0] if rows else np.zeros((0, 0))


def _tokenize(tokenizer, samples: Sequence[Sample], max_length: int, context: int | None = None) -> list[tuple[Sample, torch.Tensor]]:
    """Token ids `[1, T]` of each sample, T <= max_length, and T <= `context` (the model's max_position_embeddings):
    positions past the context the model was built for would be extrapolated, so inputs are cut there, with a warning."""
    out, cut = [], 0
    for sample in samples:
        ids = tokenizer(sample.text, add_special_tokens=True, truncation=True, max_length=max_length, return_tensors="pt")
        ids = ids["input_ids"]
        if context is not None and ids.shape[1] > context:
            ids, cut = ids[:, :context], cut + 1
        if ids.shape[1] >= 2:  # a single token has no next token and no later query
            out.append((sample, ids))
    if cut:
        warnings.warn(
            f"{cut} of {len(samples)} inputs are longer than the model's context (max_position_embeddings {context}) "
            f"and were cut to {context} tokens, not max_length {max_length}",
            GatedAttentionWarning,
        )
    return out


@torch.no_grad()
def capture_inputs(model: nn.Module, inputs, device, layout: ModelLayout | None = None) -> tuple[ModelLayout, list[InputResult], GateAccumulator]:
    """Every input through `model` once, reduced as it is produced: nothing grows with the number of inputs."""
    gates = GateAccumulator()
    results = []
    # The capture reads the residual stream, maps and gates, not the logits: the last position's is enough, and
    # all of them ([T, vocab] in fp32, 0.5 GB at 1,024 tokens of a 128k vocabulary) would outgrow a layer's map.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with Capture(model, attentions=True, gates=True, reduce=True, layout=layout) as cap:
        for sample, ids in tqdm(inputs, desc="capture", unit="input"):
            cap.clear()
            model(input_ids=ids.to(device), use_cache=False, **extra)
            record = cap.records[-1]
            token_max, sink, first_attention = reduce_record(record, cap.layout)
            total: dict[str, np.ndarray] = {}
            for f, summary in record.gate_summaries.items():
                gates.add(f, summary)
                total = {key: total.get(key, 0.0) + np.sum(value) for key, value in summary.items() if key != "hist"}
            results.append(
                InputResult(
                    sample=sample,
                    n_tokens=ids.shape[1],
                    consensus_sink=sink,
                    m_first=token_max[:, 0],
                    m_sink=token_max[:, sink] if sink >= 0 else np.full(token_max.shape[0], np.nan),
                    m_act_layers=token_max.max(axis=1),
                    first_token_attention=first_attention,
                    gate=M.gate_statistics_of(total),
                )
            )
    return cap.layout, results, gates


@torch.no_grad()
def run_interventions(model: nn.Module, inputs, device, kind: str, k: int) -> list[dict]:
    """Perplexity and next-token accuracy over all inputs, normal vs intervened, plus the identity check."""
    totals = {c: {"nll": 0.0, "correct": 0, "n": 0} for c in ("normal", "intervened")}
    identity_exact, identity_diff = 0, 0.0
    for _, ids in tqdm(inputs, desc=f"{kind} k={k}", unit="input"):
        ids = ids.to(device)
        result = intervene(model, ids, kind, k)
        identity_exact += result.identity_exact
        identity_diff = max(identity_diff, result.identity_max_abs_diff)
        targets = ids[0, 1:]
        for condition, logits in (("normal", result.logits_normal), ("intervened", result.logits_intervened)):
            logits = logits[0, :-1].float()
            totals[condition]["nll"] += F.cross_entropy(logits, targets, reduction="sum").item()
            totals[condition]["correct"] += int((logits.argmax(-1) == targets).sum())
            totals[condition]["n"] += targets.numel()
    return [
        {
            "kind": kind,
            "k": k,
            "condition": condition,
            "perplexity": math.exp(t["nll"] / t["n"]),
            "next_token_accuracy": t["correct"] / t["n"],
            "n_tokens": t["n"],
            "identity_exact_inputs": identity_exact,
            "n_inputs": len(inputs),
            "identity_max_abs_diff": identity_diff,
        }
        for condition, t in totals.items()
    ]


# ---------------------------------------------------------------- metrics over inputs


def input_metrics(result: InputResult, full_attention_layers: list[int]) -> dict:
    fa = full_attention_layers
    row = {
        "f_attn": float(np.nanmean(result.first_token_attention)) if result.first_token_attention.size else M.NAN,
        "m_act": float(result.m_act_layers[1:].mean()),
        **{f"gate_{key}": value for key, value in result.gate.items()},
    }
    for anchor, m in (("consensus_sink", result.m_sink), ("first_token", result.m_first)):
        row[f"alignment_{anchor}"] = M.sink_spike_alignment(m, fa)
        row[f"peak_excess_{anchor}"] = M.peak_excess(m, fa)
        row[f"isr_{anchor}"] = M.inter_spike_retention(m, fa)
        row[f"a_isp_{anchor}"] = M.inter_spike_activation(m, fa)
    return row


def _nanmean(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(v)) if v.size and not np.isnan(v).all() else M.NAN


def summary_rows(rows: list[dict], fa: list[int], n_bootstrap: int, seed: int) -> list[dict]:
    def ci(metric: str, anchor: str, values) -> dict:
        mean, low, high = M.bootstrap_ci(values, n_resamples=n_bootstrap, seed=seed)
        n = int(np.sum(~np.isnan(np.asarray(values, dtype=np.float64))))
        return {"metric": metric, "anchor": anchor, "mean": mean, "ci_low": low, "ci_high": high, "n": n}

    out = [
        ci("f_attn", "first_token", [r["f_attn"] for r in rows]),
        ci("m_act", "", [r["m_act"] for r in rows]),
        ci("gate_mean", "", [r["gate_mean"] for r in rows]),
        *(ci(f"gate_frac_below_{t:g}", "", [r[f"gate_frac_below_{t:g}"] for r in rows]) for t in M.GATE_THRESHOLDS),
    ]
    for anchor in ANCHORS:
        out.append(ci("sink_spike_alignment", anchor, [r[f"alignment_{anchor}"] for r in rows]))
        out.append(ci("peak_excess", anchor, [_nanmean(r[f"peak_excess_{anchor}"]) for r in rows]))
        out.append(ci("inter_spike_retention", anchor, [r[f"isr_{anchor}"] for r in rows]))
        out.append(ci("inter_spike_activation", anchor, [r[f"a_isp_{anchor}"] for r in rows]))
    baseline = M.random_layer_baseline(fa)
    out.append({"metric": "random_layer_baseline", "anchor": "", "mean": baseline, "ci_low": M.NAN, "ci_high": M.NAN, "n": len(fa)})
    if not fa:  # no softmax attention: no map to read and no sink to anchor at, so these are not reported at all
        out = [row for row in out if row["metric"] not in SINK_METRICS]
    return out


# ---------------------------------------------------------------- writing


def _write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})


def _pad_heads(arrays: list[np.ndarray]) -> np.ndarray:
    """Stack `[n_attn, H]` arrays whose H may differ per layer into `[N, n_attn, H_max]`, NaN-padded."""
    n_attn = max((a.shape[0] for a in arrays), default=0)
    heads = max((a.shape[1] for a in arrays if a.ndim == 2 and a.size), default=0)
    out = np.full((len(arrays), n_attn, heads), np.nan)
    for i, a in enumerate(arrays):
        if a.size:
            out[i, : a.shape[0], : a.shape[1]] = a
    return out


def write_arrays(out_dir: Path, layout: ModelLayout, results: list[InputResult], gates: GateAccumulator) -> None:
    gate_layers = sorted(gates.layers)
    heads = max((len(gates.layers[f]["n"]) for f in gate_layers), default=0)
    per_head = {key: np.full((len(gate_layers), heads), np.nan) for key in ("mean", "frac_below_0.1", "frac_below_0.5")}
    for i, f in enumerate(gate_layers):
        for key, value in gates.per_head(f).items():
            per_head[key][i, : len(value)] = value
    np.savez(
        out_dir / "arrays.npz",
        full_attention_layers=np.array(layout.full_attention_layers, dtype=np.int64),
        attention_rows=np.array(layout.attention_rows, dtype=np.int64).reshape(-1, 2),  # (layer, block) of each n_attn row
        layer_types=np.array(layout.layer_types),
        layer_names=np.array(layout.names),
        layer_passes=np.array(layout.passes, dtype=np.int64),
        domain=np.array([r.sample.domain for r in results]),
        source=np.array([r.sample.source for r in results]),
        n_tokens=np.array([r.n_tokens for r in results], dtype=np.int64),
        consensus_sink=np.array([r.consensus_sink for r in results], dtype=np.int64),
        m_first=np.stack([r.m_first for r in results]),
        m_sink=np.stack([r.m_sink for r in results]),
        m_act_layers=np.stack([r.m_act_layers for r in results]),
        first_token_attention=_pad_heads([r.first_token_attention for r in results]),
        gate_layers=np.array(gate_layers, dtype=np.int64),
        gate_hist_edges=M.GATE_BINS,
        gate_hist_counts=np.stack([gates.layers[f]["hist"] for f in gate_layers]) if gate_layers else np.zeros((0, len(M.GATE_BINS) - 1)),
        gate_mean=per_head["mean"],
        gate_frac_below_01=per_head["frac_below_0.1"],
        gate_frac_below_05=per_head["frac_below_0.5"],
    )


def _count_types(types: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in counts.items())


def _fmt(x) -> str:
    if isinstance(x, float):
        return "undefined" if math.isnan(x) else f"{x:.4g}"
    return str(x)


def _gate_name(site) -> str:
    """A gate as the model names it: its module under the decoder layer, and what makes its scores."""
    how = {"attn_gate": "this package's gate", "q_proj": "sigmoid of each head's second half",
           "projection": site.activation}[site.kind]
    return f"`{site.name}`, {how}"


def write_summary(out_dir: Path, model_name: str, layout: ModelLayout, results, metric_rows, intervention_rows, plots) -> None:
    fa = layout.full_attention_layers
    domains: dict[str, int] = {}
    for r in results:
        domains[r.sample.domain] = domains.get(r.sample.domain, 0) + 1
    lines = [
        f"# Analysis of `{model_name}`",
        "",
        f"- inputs: {len(results)} ({', '.join(f'{d}: {n}' for d, n in domains.items())}), "
        f"{sum(r.n_tokens for r in results)} tokens",
        f"- decoder layers: {layout.num_layers} ({_count_types(layout.layer_types)}"
        + (f"; {len(set(layout.names))} modules, some run in several passes" if max(layout.passes, default=1) > 1 else "")
        + "); "
        f"softmax-attention layers (1-based): {fa or 'none'}",
    ]
    if not fa:
        lines.append(
            "- the model has no softmax attention: the sink metrics (F-Attn, consensus sink, sink-spike alignment, "
            "peak excess, ISR, A_ISP) are left out; M-Act and the residual trajectory are reported"
        )
    else:
        lines += [
            f"- gates captured in layers: {sorted(layout.gates) or 'none (model has no attention gates)'}"
            + "".join(f" ({name})" for name in dict.fromkeys(_gate_name(site) for site in layout.gates.values())),
            f"- consensus sink = first token in {sum(r.consensus_sink == 0 for r in results)}/{len(results)} inputs",
        ]
    lines += [
        "",
        "## Metrics (mean and 95% bootstrap CI over inputs)",
        "",
        "| metric | anchor | mean | 95% CI | n |",
        "|---|---|---|---|---|",
    ]
    for row in metric_rows:
        interval = "" if math.isnan(row["ci_low"]) else f"[{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}]"
        lines.append(f"| {row['metric']} | {row['anchor']} | {_fmt(row['mean'])} | {interval} | {row['n']} |")
    if len(fa) == 1:
        lines += ["", "Inter-spike retention/activation are undefined: they need at least two attention layers."]
    elif all(f_next == f + 1 for f, f_next in zip(fa[:-1], fa[1:])):
        lines += ["", "Inter-spike retention/activation are undefined: no linear-attention layer lies between attention layers."]
    if intervention_rows:
        lines += ["", f"## Intervention: {intervention_rows[0]['kind']}, k = {intervention_rows[0]['k']}", ""]
        lines += ["| condition | perplexity | next-token accuracy | tokens |", "|---|---|---|---|"]
        for row in intervention_rows:
            lines.append(
                f"| {row['condition']} | {_fmt(row['perplexity'])} | {_fmt(row['next_token_accuracy'])} | {row['n_tokens']} |"
            )
        row = intervention_rows[0]
        lines += [
            "",
            f"Identity check (endpoints pinned only): exact on {row['identity_exact_inputs']}/{row['n_inputs']} inputs, "
            f"max |logit diff| {row['identity_max_abs_diff']:.3g}.",
        ]
    files = ["arrays.npz", "inputs.csv", "layers.csv", "peak_excess.csv", "gates.csv", "metrics.csv"]
    files += ["intervention.csv"] if intervention_rows else []
    lines += ["", "Files: " + ", ".join(f"`{f}`" for f in files + plots), ""]
    (out_dir / "summary.md").write_text("\n".join(lines))


def run_analysis(
    model: nn.Module,
    tokenizer,
    samples: Sequence[Sample],
    out_dir: str | Path,
    *,
    model_name: str = "model",
    max_length: int = 128,
    intervention: str | None = None,
    k: int = 1,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> list[dict]:
    """Analyse `samples` with `model`; write everything to `out_dir`; return the metric rows."""
    from .plots import plot_all

    out_dir = Path(out_dir)
    layout = model_layout(model)  # first: a model it refuses (its inputs no text tokens) is one line, before any input
    device = input_device(model)
    context = getattr(model.config, "max_position_embeddings", None)  # XLNet's is -1: no limit
    inputs = _tokenize(tokenizer, samples, max_length, context if isinstance(context, int) and context > 0 else None)
    if not inputs:
        raise ValueError("no input has at least two tokens")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    largest = max(int(ids.max()) for _, ids in inputs)
    if rows is not None and largest >= rows:  # the embedding would raise IndexError
        raise ValueError(f"MODEL {model_name}: the tokenizer gives token id {largest}, and the model's embedding has "
                         f"{rows} rows: the tokenizer is not this model's (see --tokenizer)")
    if intervention and not layout.full_attention_layers:
        raise ValueError(f"--intervene acts at the inputs of attention layers, and {type(model).__name__} has no softmax attention")
    if intervention and layout.streams > 1:
        raise ValueError(f"--intervene edits one residual stream, and {type(model).__name__} carries several (n-gram streams)")
    if intervention and layout.prefix:
        raise ValueError(f"--intervene edits the first token, and {type(model).__name__} puts its prompt tokens before it")
    if intervention and layout.residual_head is not None:
        raise ValueError(f"--intervene edits one residual stream, and {type(model).__name__} carries several (hyper-connections)")

    layout, results, gates = capture_inputs(model, inputs, device, layout)
    fa = layout.full_attention_layers
    rows = [input_metrics(r, fa) for r in results]
    gate_table = gates.table()
    metric_rows = summary_rows(rows, fa, n_bootstrap, seed)

    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a run that fails before this leaves no empty folder
    write_arrays(out_dir, layout, results, gates)
    input_columns = ["input", "domain", "source", "n_tokens", "consensus_sink", "f_attn", "m_act"]
    input_columns += [f"gate_{key}" for key in M.gate_statistics([])]
    input_columns += [f"{m}_{a}" for a in ANCHORS for m in ("alignment", "isr", "a_isp")]
    if not fa:  # no softmax attention: only what the residual stream defines
        input_columns = ["input", "domain", "source", "n_tokens", "m_act"]
    _write_csv(
        out_dir / "inputs.csv",
        [
            {"input": i, "domain": r.sample.domain, "source": r.sample.source, "n_tokens": r.n_tokens,
             "consensus_sink": r.consensus_sink, **row}
            for i, (r, row) in enumerate(zip(results, rows))
        ],
        input_columns,
    )
    peak_rows = [
        {"input": i, "anchor": a, "layer": f, "peak_excess": v}
        for i, row in enumerate(rows)
        for a in ANCHORS
        for f, v in zip(fa, row[f"peak_excess_{a}"])
    ]
    _write_csv(out_dir / "peak_excess.csv", peak_rows, ["input", "anchor", "layer", "peak_excess"])
    _write_csv(out_dir / "gates.csv", gate_table, ["layer", "head", "mean", "frac_below_0.1", "frac_below_0.5", "n_scores"])
    _write_csv(out_dir / "metrics.csv", metric_rows, ["metric", "anchor", "mean", "ci_low", "ci_high", "n"])

    first_attention = _pad_heads([r.first_token_attention for r in results])
    rows_of = layout.attention_rows
    gate_means = {f: float(np.mean(gates.per_head(f)["mean"])) for f in gates.layers}
    layer_rows = []
    for l in range(layout.num_layers + 1):
        row = {
            "layer": l,
            "name": "embedding" if l == 0 else layout.names[l - 1],
            "pass": "" if l == 0 else layout.passes[l - 1],
            "layer_type": "embedding" if l == 0 else layout.layer_types[l - 1],
            "is_attention": l in fa,
            "m_act": float(np.mean([r.m_act_layers[l] for r in results])),
            "m_first": float(np.mean([r.m_first[l] for r in results])),
            "m_sink": float(np.mean([r.m_sink[l] for r in results])) if fa else "",
            "gate_mean": gate_means.get(l, ""),
        }
        if l in fa and first_attention.size:
            row["f_attn"] = float(np.nanmean(first_attention[:, rows_of.index((l, 1))]))
        layer_rows.append(row)
        for k in range(2, 2 + len(layout.later_blocks.get(l, []))):  # a later attention block: its map, no state of its own
            layer_rows.append({"layer": l, "name": layout.block_name(l, k), "pass": row["pass"], "layer_type": row["layer_type"],
                               "is_attention": True, "f_attn": float(np.nanmean(first_attention[:, rows_of.index((l, k))]))})
    _write_csv(
        out_dir / "layers.csv",
        layer_rows,
        ["layer", "name", "pass", "layer_type", "is_attention", "m_act", "m_first", "m_sink", "f_attn", "gate_mean"],
    )

    intervention_rows = []
    if intervention:
        intervention_rows = run_interventions(model, inputs, device, intervention, k)
        _write_csv(out_dir / "intervention.csv", intervention_rows, list(intervention_rows[0]))

    plots = plot_all(out_dir)
    write_summary(out_dir, model_name, layout, results, metric_rows, intervention_rows, plots)
    return metric_rows
