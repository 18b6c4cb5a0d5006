"""`run_analysis`: check the inputs, capture every one, reduce it to metrics, then write the files (`tables`).

Each step is a function of its own: `checked_inputs` and `check_intervention` (bad input is a `ValueError`, one
line, before any input runs), `capture_inputs` (every input through the model once, reduced as it is produced),
`input_metrics` and `summary_rows` (the metrics per input, and their means and intervals over inputs),
`run_interventions`, and one writer per file in `tables`. `summary.md` is written last, so a folder without it is an
interrupted run.

Two anchors: `first_token` (token 0, the massive-activations paper's figures) and `consensus_sink`
(the input's consensus sink, that paper's quantitative metrics).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import GatedAttentionWarning
from . import metrics, tables
from .capture import Capture, Record
from .interventions import attention_inputs, intervene, token_means
from .layout import ModelLayout, input_device, model_layout
from .loading import check_token_ids
from .samples import Sample
from .tables import ANCHORS, GateAccumulator, InputResult, pad_heads, reported

Inputs = list[tuple[Sample, torch.Tensor]]  # each sample with its token ids [1, T]


# ---------------------------------------------------------------- check


def _tokenize(tokenizer, samples: Sequence[Sample], max_length: int, context: int | None = None) -> Inputs:
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


def checked_inputs(model: nn.Module, tokenizer, samples: Sequence[Sample], max_length: int, model_name: str) -> Inputs:
    """`samples` as token ids the model can take, or a `ValueError` (one line)."""
    context = getattr(model.config, "max_position_embeddings", None)  # XLNet's is -1: no limit
    inputs = _tokenize(tokenizer, samples, max_length, context if isinstance(context, int) and context > 0 else None)
    if not inputs:
        raise ValueError("no input has at least two tokens")
    check_token_ids(model, max(int(ids.max()) for _, ids in inputs), model_name)
    return inputs


def check_intervention(model: nn.Module, layout: ModelLayout, intervention: str | None, inputs: Inputs,
                       layers: Sequence[int] | None = None, tokens: Sequence[int] = (0,)) -> None:
    """An intervention the model or the inputs cannot take is a `ValueError` (one line), before any input runs:
    `layers` (residual positions X[l], l = 0..L; None: the attention layers' inputs) past the model's depth,
    `tokens` past the shortest input, a model whose residual state cannot be edited."""
    if not intervention:
        return
    name = type(model).__name__
    if layers is None and not layout.attention_layers:
        hint = "" if intervention == "connection" else " (--intervene-layers chooses other residual positions)"
        raise ValueError(f"--intervene acts at the inputs of attention layers, and {name} has no softmax attention{hint}")
    depth = layout.num_layers
    outside = sorted(p for p in layers or () if not 0 <= p <= depth)
    if outside:
        raise ValueError(f"--intervene-layers {' '.join(map(str, outside))}: {name}'s residual positions are 0 (the "
                         f"embedding output) to {depth} (the output of decoder layer {depth})")
    shortest = min(ids.shape[1] for _, ids in inputs)
    past = sorted(t for t in tokens if not 0 <= t < shortest)
    if past:
        raise ValueError(f"--intervene-tokens {' '.join(map(str, past))}: the shortest input has {shortest} tokens "
                         f"(positions 0 to {shortest - 1})")
    if layout.view.edit_refusal:
        raise ValueError(f"--intervene edits the residual state, and {name} cannot have it edited: "
                         f"{layout.view.edit_refusal}")


# ---------------------------------------------------------------- capture


def reduce_record(record: Record, layout: ModelLayout, b: int = 0) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Input b of a reduced Record -> (token max |X| `[L+1, T]`, consensus sink, first-token attention `[n_attn, H]`,
    first-token importance `[n_attn, H]`).

    n_attn counts attention blocks (`layout.attention_rows`: a layer with two has two rows), and the consensus sink
    averages over all of them. Blocks with fewer heads than others (Inkling2's full and sliding layers differ) are
    NaN-padded to the most."""
    token_max = torch.stack([x[b].cpu() for x in record.token_max]).numpy()  # the layers may sit on several devices
    rows = layout.attention_rows
    sink = metrics.consensus_sink_of(record.received[row][b].cpu().numpy() for row in rows)

    def per_head(what: dict) -> np.ndarray:
        return pad_heads([what[row][b].cpu().numpy()[None] for row in rows])[:, 0] if rows else np.zeros((0, 0))

    return token_max, sink, per_head(record.first_token_attention), per_head(record.first_token_importance)


@torch.no_grad()
def capture_inputs(model: nn.Module, inputs: Inputs, device, layout: ModelLayout | None = None
                   ) -> tuple[ModelLayout, list[InputResult], GateAccumulator]:
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
            token_max, sink, first_attention, importance = reduce_record(record, cap.layout)
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
                    first_token_importance=importance,
                    gate=metrics.gate_statistics_of(total),
                )
            )
    return cap.layout, results, gates


# ---------------------------------------------------------------- metrics over inputs


def input_metrics(result: InputResult, attention_layers: list[int], sink_epsilon: float = metrics.SINK_EPSILON) -> dict:
    """One input's metrics: F-Attn, the sink rate, M-Act, its gate statistics and the spike/plateau metrics at each
    anchor (`attention_layers`: 1-based, the layers that hold softmax attention)."""
    fa = attention_layers
    row = {
        "f_attn": float(np.nanmean(result.first_token_attention)) if result.first_token_attention.size else metrics.NAN,
        "sink_rate": metrics.sink_rate(result.first_token_importance, sink_epsilon),
        "m_act": float(result.m_act_layers[1:].mean()),
        **{f"gate_{key}": value for key, value in result.gate.items()},
    }
    for anchor, m in (("consensus_sink", result.m_sink), ("first_token", result.m_first)):
        row[f"alignment_{anchor}"] = metrics.sink_spike_alignment(m, fa)
        row[f"peak_excess_{anchor}"] = metrics.peak_excess(m, fa)
        row[f"isr_{anchor}"] = metrics.inter_spike_retention(m, fa)
        row[f"a_isp_{anchor}"] = metrics.inter_spike_activation(m, fa)
    return row


def _nanmean(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(v)) if v.size and not np.isnan(v).all() else metrics.NAN


def summary_rows(per_input: list[dict], attention_layers: list[int], n_bootstrap: int, seed: int) -> list[dict]:
    """Each metric's mean and 95% bootstrap interval over inputs, from `input_metrics` rows."""

    def ci(metric: str, anchor: str, values) -> dict:
        mean, low, high = metrics.bootstrap_ci(values, n_resamples=n_bootstrap, seed=seed)
        n = int(np.sum(~np.isnan(np.asarray(values, dtype=np.float64))))
        return {"metric": metric, "anchor": anchor, "mean": mean, "ci_low": low, "ci_high": high, "n": n}

    out = [
        ci("f_attn", "first_token", [r["f_attn"] for r in per_input]),
        ci("sink_rate", "first_token", [r["sink_rate"] for r in per_input]),
        ci("m_act", "", [r["m_act"] for r in per_input]),
        ci("gate_mean", "", [r["gate_mean"] for r in per_input]),
        *(ci(key, "", [r[key] for r in per_input]) for key in (f"gate_{metrics.frac_below(t)}" for t in metrics.GATE_THRESHOLDS)),
    ]
    for anchor in ANCHORS:
        out.append(ci("sink_spike_alignment", anchor, [r[f"alignment_{anchor}"] for r in per_input]))
        out.append(ci("peak_excess", anchor, [_nanmean(r[f"peak_excess_{anchor}"]) for r in per_input]))
        out.append(ci("inter_spike_retention", anchor, [r[f"isr_{anchor}"] for r in per_input]))
        out.append(ci("inter_spike_activation", anchor, [r[f"a_isp_{anchor}"] for r in per_input]))
    baseline = metrics.random_layer_baseline(attention_layers)
    out.append({"metric": "random_layer_baseline", "anchor": "", "mean": baseline, "ci_low": metrics.NAN,
                "ci_high": metrics.NAN, "n": len(attention_layers)})
    return [row for row in out if reported(row["metric"], attention_layers)]


# ---------------------------------------------------------------- interventions


@torch.no_grad()
def run_interventions(model: nn.Module, inputs: Inputs, device, kind: str, k: int, positions: Sequence[int],
                      tokens: Sequence[int] = (0,)) -> list[dict]:
    """Perplexity and next-token accuracy over all inputs, normal vs intervened at residual `positions` (l = 0..L)
    on `tokens`, plus the identity check.

    "set-mean" sets each coordinate to its mean over these inputs (`interventions.token_means`), read first."""
    positions, tokens = sorted(set(positions)), sorted(set(tokens))
    mean = token_means(model, [ids.to(device) for _, ids in inputs], tokens) if kind == "set-mean" else None
    totals = {c: {"nll": 0.0, "correct": 0, "n": 0} for c in ("normal", "intervened")}
    identity_exact, identity_diff = 0, 0.0
    for _, ids in tqdm(inputs, desc=f"{kind} k={k}", unit="input"):
        ids = ids.to(device)
        result = intervene(model, ids, kind, k, mean=mean, positions=positions, tokens=tokens)
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
            "intervene_layers": " ".join(map(str, positions)),
            "intervene_tokens": " ".join(map(str, tokens)),
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


# ---------------------------------------------------------------- the whole run


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
    intervene_layers: Sequence[int] | None = None,
    intervene_tokens: Sequence[int] = (0,),
    n_bootstrap: int = 1000,
    seed: int = 0,
    sink_epsilon: float = metrics.SINK_EPSILON,
    quantization: Sequence[str] = (),
) -> list[dict]:
    """Analyse `samples` with `model`; write everything to `out_dir`; return the metric rows.

    `intervention` ("deletion", "set-mean", "connection") acts on the `intervene_tokens` (0-based) at the residual
    positions `intervene_layers` (X[l], l = 0..L: X[0] the embedding output, X[l] the output of decoder layer l;
    None: the inputs of the attention layers, X[f-1]).

    `quantization`: compressed-tensors' preset names; each scheme's arms are measured against the model on the
    same inputs (`quantization.measure`), with the outlier statistics of the layers' inputs."""
    from .plots import plot_all

    out_dir = Path(out_dir)
    layout = model_layout(model)  # first: a model it refuses (its inputs no text tokens) is one line, before any input
    inputs = checked_inputs(model, tokenizer, samples, max_length, model_name)
    check_intervention(model, layout, intervention, inputs, intervene_layers, intervene_tokens)

    device = input_device(model)
    layout, results, gates = capture_inputs(model, inputs, device, layout)
    per_input = [input_metrics(r, layout.attention_layers, sink_epsilon) for r in results]
    metric_rows = summary_rows(per_input, layout.attention_layers, n_bootstrap, seed)
    intervention_rows = []
    if intervention:
        positions = attention_inputs(layout.attention_layers) if intervene_layers is None else intervene_layers
        intervention_rows = run_interventions(model, inputs, device, intervention, k, positions, intervene_tokens)

    quantization_rows, outlier_rows = [], []
    if quantization:
        from ..quantization import measure

        ids = [ids.to(device) for _, ids in inputs]
        _, quantization_rows = measure.measure(model, ids, quantization)
        outlier_rows = measure.outliers(model, ids)

    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a run that fails before this leaves no empty folder
    tables.write_arrays(out_dir, layout, results, gates, sink_epsilon)
    tables.write_inputs(out_dir, layout, results, per_input)
    tables.write_layers(out_dir, layout, results, gates, sink_epsilon)
    tables.write_peak_excess(out_dir, layout, per_input)
    tables.write_gates(out_dir, gates)
    tables.write_metrics(out_dir, metric_rows)
    if intervention_rows:
        tables.write_intervention(out_dir, intervention_rows)
    if quantization_rows:
        tables.write_quantization(out_dir, quantization_rows, outlier_rows)
    plots = plot_all(out_dir)
    tables.write_summary(out_dir, model_name, layout, results, metric_rows, intervention_rows, plots, sink_epsilon,
                         quantization_rows, outlier_rows)
    return metric_rows
