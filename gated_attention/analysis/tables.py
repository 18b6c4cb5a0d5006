"""The files `run_analysis` writes, each from what was measured: one writer per file.

What they are written from: `InputResult` (one input, reduced as it was captured), `GateAccumulator` (the gate
scores' sums over inputs), the per-input metric rows (`analyze.input_metrics`) and the summary rows over inputs
(`analyze.summary_rows`).

- `arrays.npz` (`write_arrays`): per-input trajectories `m_first`, `m_sink`, `m_act_layers` `[N, L+1]`,
  `first_token_attention` and `first_token_importance` `[N, n_attn, H]` (n_attn: one row per attention block,
  `attention_rows`), `consensus_sink`, gate histograms and per-head gate stats.
- `inputs.csv`, `layers.csv`, `peak_excess.csv`, `gates.csv`, `metrics.csv` (metric, anchor, mean and 95% bootstrap
  CI over inputs), `intervention.csv`, `quantization.csv` and `quantization_layers.csv` (`write_quantization`).
- `summary.md` (`write_summary`), written last by `run_analysis`: a folder without it is an interrupted run.

Layers are decoder-layer calls (`ModelLayout.layers`): in a model that runs some layers several times in one
forward, each pass is its own row of every per-layer array and of `layers.csv` (`name`: the module's path,
`pass`: its k-th call), its F-Attn read from that call's map and its M-Act from that call's output, as
transformers' `output_attentions` / `output_hidden_states` return one per call. A layer that holds several
attention blocks (Longcat-Flash) has a row for each later block after its own, named by the block's module, with
its F-Attn and sink rate and no residual columns: the model returns no state between its blocks.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import metrics
from ..modeling.gate_sites import GateSite
from .layout import ModelLayout
from .samples import Sample

ANCHORS = ("consensus_sink", "first_token")
# The metrics read from attention maps or anchored at the consensus sink (metrics.csv's names), with the names the
# summary gives them: a model without softmax attention has no map to read and no sink to anchor at, so none of
# them is reported (`reported`), only M-Act and the residual trajectory.
SINK_METRICS = {
    "f_attn": "F-Attn", "sink_rate": "sink rate", "consensus_sink": "consensus sink",
    "sink_spike_alignment": "sink-spike alignment", "peak_excess": "peak excess", "inter_spike_retention": "ISR",
    "inter_spike_activation": "A_ISP", "random_layer_baseline": "",
}
# inputs.csv's columns of an anchored metric: `<prefix>_<anchor>`
_ANCHORED_COLUMNS = {"alignment": "sink_spike_alignment", "peak_excess": "peak_excess", "isr": "inter_spike_retention",
                     "a_isp": "inter_spike_activation"}


def reported(name: str, attention_layers: Sequence[int]) -> bool:
    """Whether a metric (metrics.csv's name) or a column of inputs.csv is reported for a model whose softmax-attention
    layers are `attention_layers`: all are where there are any; without, none of `SINK_METRICS`."""
    if attention_layers:
        return True
    metric = next((m for prefix, m in _ANCHORED_COLUMNS.items() if name in (f"{prefix}_{a}" for a in ANCHORS)), name)
    return metric not in SINK_METRICS


GATE_STATISTICS = ("mean", *map(metrics.frac_below, metrics.GATE_THRESHOLDS))  # per head, in gates.csv and arrays.npz


@dataclass
class InputResult:
    sample: Sample
    n_tokens: int
    consensus_sink: int  # -1 when the model has no softmax attention
    m_first: np.ndarray  # [L+1]
    m_sink: np.ndarray  # [L+1], NaN when there is no consensus sink
    m_act_layers: np.ndarray  # [L+1]
    first_token_attention: np.ndarray  # [n_attn, H], over queries q >= 1
    first_token_importance: np.ndarray  # [n_attn, H], over all queries (`metrics.first_token_importance`)
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
        return {"mean": acc["sum"] / acc["n"],
                **{metrics.frac_below(t): acc[f"below_{t:g}"] / acc["n"] for t in metrics.GATE_THRESHOLDS}}

    def table(self) -> list[dict]:
        rows = []
        for f in sorted(self.layers):
            stats, n = self.per_head(f), self.layers[f]["n"]
            for h in range(len(n)):
                rows.append({"layer": f, "head": h, "n_scores": int(n[h]), **{key: value[h] for key, value in stats.items()}})
        return rows


def pad_heads(arrays: list[np.ndarray]) -> np.ndarray:
    """Stack `[n_attn, H]` arrays whose H may differ per layer into `[N, n_attn, H_max]`, NaN-padded."""
    n_attn = max((a.shape[0] for a in arrays), default=0)
    heads = max((a.shape[1] for a in arrays if a.ndim == 2 and a.size), default=0)
    out = np.full((len(arrays), n_attn, heads), np.nan)
    for i, a in enumerate(arrays):
        if a.size:
            out[i, : a.shape[0], : a.shape[1]] = a
    return out


def _write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})


# ---------------------------------------------------------------- one writer per file


def write_arrays(out_dir: Path, layout: ModelLayout, results: list[InputResult], gates: GateAccumulator,
                 sink_epsilon: float) -> None:
    gate_layers = sorted(gates.layers)
    heads = max((len(gates.layers[f]["n"]) for f in gate_layers), default=0)
    per_head = {key: np.full((len(gate_layers), heads), np.nan) for key in GATE_STATISTICS}
    for i, f in enumerate(gate_layers):
        for key, value in gates.per_head(f).items():
            per_head[key][i, : len(value)] = value
    np.savez(
        out_dir / "arrays.npz",
        # The layers that hold softmax attention, full or sliding-window (the name the hybrid paper's definitions use).
        full_attention_layers=np.array(layout.attention_layers, dtype=np.int64),
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
        first_token_attention=pad_heads([r.first_token_attention for r in results]),
        first_token_importance=pad_heads([r.first_token_importance for r in results]),
        sink_epsilon=np.float64(sink_epsilon),
        gate_layers=np.array(gate_layers, dtype=np.int64),
        gate_hist_edges=metrics.GATE_BINS,
        gate_hist_counts=(np.stack([gates.layers[f]["hist"] for f in gate_layers]) if gate_layers
                          else np.zeros((0, len(metrics.GATE_BINS) - 1))),
        **{"gate_" + key.replace(".", ""): value for key, value in per_head.items()},  # gate_mean, gate_frac_below_01
    )


def write_inputs(out_dir: Path, layout: ModelLayout, results: list[InputResult], per_input: list[dict]) -> None:
    """`inputs.csv`: one row per input, its metrics (`analyze.input_metrics`)."""
    columns = ["input", "domain", "source", "n_tokens", "consensus_sink", "f_attn", "sink_rate", "m_act"]
    if layout.attention_layers:  # gate scores come from attention layers
        columns += [f"gate_{key}" for key in metrics.gate_statistics([])]
    columns += [f"{m}_{a}" for a in ANCHORS for m in ("alignment", "isr", "a_isp")]
    columns = [c for c in columns if reported(c, layout.attention_layers)]
    rows = [{"input": i, "domain": r.sample.domain, "source": r.sample.source, "n_tokens": r.n_tokens,
             "consensus_sink": r.consensus_sink, **row}
            for i, (r, row) in enumerate(zip(results, per_input))]
    _write_csv(out_dir / "inputs.csv", rows, columns)


def write_layers(out_dir: Path, layout: ModelLayout, results: list[InputResult], gates: GateAccumulator,
                 sink_epsilon: float) -> None:
    """`layers.csv`: one row per residual state (0: the embedding) and per later attention block, averaged over
    inputs: M-Act, the first token's and the consensus sink's largest |X|, and for attention layers F-Attn, the sink
    rate (`metrics.sink_rate` of the layer's heads) and the gate's mean score."""
    attention = set(layout.attention_layers)
    first_attention = pad_heads([r.first_token_attention for r in results])  # [N, n_attn, H]
    importance = pad_heads([r.first_token_importance for r in results])
    rows_of = layout.attention_rows
    gate_means = {f: float(np.mean(gates.per_head(f)["mean"])) for f in gates.layers}

    def attention_columns(layer: int, b: int) -> dict:
        row = rows_of.index((layer, b))
        if not first_attention.size:
            return {}
        return {"f_attn": float(np.nanmean(first_attention[:, row])),
                "sink_rate": float(np.nanmean([metrics.sink_rate(heads[None], sink_epsilon) for heads in importance[:, row]]))}

    rows = []
    for layer in range(layout.num_layers + 1):
        row = {
            "layer": layer,
            "name": "embedding" if layer == 0 else layout.names[layer - 1],
            "pass": "" if layer == 0 else layout.passes[layer - 1],
            "layer_type": "embedding" if layer == 0 else layout.layer_types[layer - 1],
            "is_attention": layer in attention,
            "m_act": float(np.mean([r.m_act_layers[layer] for r in results])),
            "m_first": float(np.mean([r.m_first[layer] for r in results])),
            "m_sink": float(np.mean([r.m_sink[layer] for r in results])) if attention else "",
            "gate_mean": gate_means.get(layer, ""),
            **(attention_columns(layer, 1) if layer in attention else {}),
        }
        rows.append(row)
        for b in range(2, 2 + len(layout.later_blocks.get(layer, []))):  # a later attention block: its map, no state
            rows.append({"layer": layer, "name": layout.block_name(layer, b), "pass": row["pass"],
                         "layer_type": row["layer_type"], "is_attention": True, **attention_columns(layer, b)})
    _write_csv(out_dir / "layers.csv", rows, ["layer", "name", "pass", "layer_type", "is_attention", "m_act", "m_first",
                                              "m_sink", "f_attn", "sink_rate", "gate_mean"])


def write_peak_excess(out_dir: Path, layout: ModelLayout, per_input: list[dict]) -> None:
    """`peak_excess.csv`: one row per input, anchor and attention layer."""
    rows = [{"input": i, "anchor": a, "layer": f, "peak_excess": v}
            for i, row in enumerate(per_input) for a in ANCHORS
            for f, v in zip(layout.attention_layers, row[f"peak_excess_{a}"])]
    _write_csv(out_dir / "peak_excess.csv", rows, ["input", "anchor", "layer", "peak_excess"])


def write_gates(out_dir: Path, gates: GateAccumulator) -> None:
    """`gates.csv`: one row per gated layer and head."""
    _write_csv(out_dir / "gates.csv", gates.table(), ["layer", "head", *GATE_STATISTICS, "n_scores"])


def write_metrics(out_dir: Path, metric_rows: list[dict]) -> None:
    """`metrics.csv`: each metric's mean and 95% bootstrap interval over inputs (`analyze.summary_rows`)."""
    _write_csv(out_dir / "metrics.csv", metric_rows, ["metric", "anchor", "mean", "ci_low", "ci_high", "n"])


def write_intervention(out_dir: Path, intervention_rows: list[dict]) -> None:
    """`intervention.csv`: perplexity and next-token accuracy, normal and intervened (`analyze.run_interventions`)."""
    _write_csv(out_dir / "intervention.csv", intervention_rows, list(intervention_rows[0]))


# ---------------------------------------------------------------- summary.md


def _count_types(types: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in counts.items())


def _fmt(x) -> str:
    if isinstance(x, float):
        return "undefined" if math.isnan(x) else f"{x:.4g}"
    return str(x)


def _gate_name(site: GateSite) -> str:
    """A gate as the model names it: its module under the decoder layer, and what makes its scores."""
    how = {"attn_gate": "this package's gate", "q_proj": "sigmoid of each head's second half",
           "projection": site.activation,
           "sinks": "what a learned sink leaves the keys, sigmoid(lse - sink)"}[site.kind]
    return f"`{site.name}`, {how}"


def write_quantization(out_dir: Path, rows: list[dict], outlier_rows: list[dict]) -> None:
    """`quantization.csv`: perplexity, KL and top-1 agreement per scheme and arm, the unquantized model's first
    (`quantization.measure`); `quantization_layers.csv`: the outlier statistics of each measured layer's input."""
    _write_csv(out_dir / "quantization.csv", rows, list(rows[0]))
    if outlier_rows:
        _write_csv(out_dir / "quantization_layers.csv", outlier_rows, list(outlier_rows[0]))


def _quantization_lines(rows: list[dict], outlier_rows: list[dict]) -> list[str]:
    """The summary's quantization section: the table, then per scheme whether keeping the gates paid."""
    reference = rows[0]
    lines = ["", "## Quantization (compressed-tensors' schemes, round-to-nearest, min-max scales)", "",
             f"Unquantized: perplexity {_fmt(reference['perplexity'])} over {reference['n_tokens']} predictions, "
             f"{reference['weight_bytes']:,} bytes of rounded linear maps at 16 bits. KL: mean KL(unquantized || "
             "quantized) of the next-token distributions, in nats.", "",
             "| scheme | arm | perplexity | change | KL | top-1 agreement | bytes |", "|---|---|---|---|---|---|---|"]
    for row in rows[1:]:
        lines.append(f"| {row['scheme']} | {row['arm']} | {_fmt(row['perplexity'])} | {row['perplexity_change']:+.2%} | "
                     f"{row['kl']:.3g} | {row['top1_agreement']:.3f} | {row['weight_bytes']:,} |")
    by_arm = {(row["scheme"], row["arm"]): row for row in rows[1:]}
    lines.append("")
    for scheme in dict.fromkeys(row["scheme"] for row in rows[1:]):
        every, kept = by_arm[(scheme, "all")], by_arm.get((scheme, "gates_kept"))
        if kept is None:
            lines.append(f"- {scheme}: the model has no gate of linear maps: `all` is the only arm.")
            continue
        paid = kept["kl"] < every["kl"]
        change = (kept["kl"] - every["kl"]) / every["kl"] if every["kl"] else math.nan
        extra = kept["weight_bytes"] - every["weight_bytes"]
        lines.append(f"- {scheme}: keeping the gates in 16 bits {'paid' if paid else 'did not pay'}: KL "
                     f"{every['kl']:.3g} -> {kept['kl']:.3g} ({change:+.1%}) for {extra:+,} bytes "
                     f"({extra / every['weight_bytes']:+.1%} of the quantized linear maps).")
    if outlier_rows:
        lines += ["", "Inputs of the layers (`quantization_layers.csv`), mean over layers: "
                  + "; ".join(f"{kind} kurtosis {_fmt(float(np.mean([r['kurtosis'] for r in outlier_rows if r['kind'] == kind])))}, "
                              f"max/median {_fmt(float(np.mean([r['max_over_median'] for r in outlier_rows if r['kind'] == kind])))}"
                              for kind in dict.fromkeys(r["kind"] for r in outlier_rows)) + "."]
    return lines


def write_summary(out_dir: Path, model_name: str, layout: ModelLayout, results: list[InputResult],
                  metric_rows: list[dict], intervention_rows: list[dict], plots: list[str], sink_epsilon: float,
                  quantization_rows: Sequence[dict] = (), outlier_rows: Sequence[dict] = ()) -> None:
    fa = layout.attention_layers
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
            f"- the model has no softmax attention: the sink metrics ({', '.join(filter(None, SINK_METRICS.values()))}) "
            "are left out; M-Act and the residual trajectory are reported"
        )
    else:
        lines += [
            f"- gates captured in layers: {sorted(layout.gates) or 'none (model has no attention gates)'}"
            + "".join(f" ({name})" for name in dict.fromkeys(_gate_name(site) for site in layout.gates.values())),
            f"- consensus sink = first token in {sum(r.consensus_sink == 0 for r in results)}/{len(results)} inputs",
            f"- sink rate (Gu et al. 2024): the fraction of heads whose mean attention on the first token, over all "
            f"queries, exceeds epsilon = {sink_epsilon:g}, averaged over attention layers",
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
        first = intervention_rows[0]
        tokens, layers = (first[key].replace(" ", ", ") for key in ("intervene_tokens", "intervene_layers"))
        lines += ["", f"## Intervention: {first['kind']}, k = {first['k']}", "",
                  f"On token {tokens} at X[l] for l = {layers} (X[0] the embedding output, X[l] the output of decoder "
                  "layer l).", ""]
        lines += ["| condition | perplexity | next-token accuracy | tokens |", "|---|---|---|---|"]
        for row in intervention_rows:
            lines.append(
                f"| {row['condition']} | {_fmt(row['perplexity'])} | {_fmt(row['next_token_accuracy'])} | {row['n_tokens']} |"
            )
        lines += [
            "",
            f"Identity check (endpoints pinned only): exact on {first['identity_exact_inputs']}/{first['n_inputs']} "
            f"inputs, max |logit diff| {first['identity_max_abs_diff']:.3g}.",
        ]
    if quantization_rows:
        lines += _quantization_lines(list(quantization_rows), list(outlier_rows))
    files = ["arrays.npz", "inputs.csv", "layers.csv", "peak_excess.csv", "gates.csv", "metrics.csv"]
    files += ["intervention.csv"] if intervention_rows else []
    files += ["quantization.csv"] if quantization_rows else []
    files += ["quantization_layers.csv"] if outlier_rows else []
    lines += ["", "Files: " + ", ".join(f"`{f}`" for f in files + plots), ""]
    (out_dir / "summary.md").write_text("\n".join(lines))
