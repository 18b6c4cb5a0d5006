"""Attention-sink, massive-activation, gate and spike/plateau metrics on plain arrays.

Index conventions (docs/architecture.md, "Metric definitions"), written down once:

- `m` is one token's residual trajectory, a 1-D array of length L+1:
  `m[l] = max_j |X[l][t, j]|`, where `X[0]` is the embedding output (the input
  of decoder layer 1) and `X[l]` the output of decoder layer l, 1-based
  (HF `layer_idx = l - 1`). `X[L]` is before the final norm.
- Full-attention layers `f` are 1-based. The input of layer f is `X[f-1]`,
  the "pre-attention position" `p = f - 1`.
- Block `B_f`: residual positions from just after the previous full-attention
  layer (layer 1 if there is none) up to and including `f - 1`; when that range
  is empty (two adjacent attention layers, or f = 1) the block is `{f - 1}`.

Undefined values are `float("nan")`, never an exception; `consensus_sink`
returns -1 when no token has a later query. Layer indices outside 1..L raise
`ValueError`: that is a caller's bug, not an undefined value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

NAN = float("nan")
SINK_EPSILON = 0.3  # Gu et al. 2024's threshold on a head's attention to the first token
GATE_THRESHOLDS = (0.1, 0.5)
GATE_BINS = np.linspace(0.0, 1.0, 51)  # gate-score histogram edges


def frac_below(t: float) -> str:
    """The key of the fraction of gate scores below threshold t: `frac_below_0.1`."""
    return f"frac_below_{t:g}"


def _check_layers(m: np.ndarray, full_attention_layers: Sequence[int]) -> list[int]:
    layers = sorted({int(f) for f in full_attention_layers})
    num_layers = len(m) - 1
    if layers and (layers[0] < 1 or layers[-1] > num_layers):
        raise ValueError(f"full-attention layers must lie in 1..{num_layers} (1-based), got {layers}")
    return layers


def attention_blocks(full_attention_layers: Sequence[int]) -> dict[int, list[int]]:
    """`B_f` for every full-attention layer f: the residual positions of its preceding block."""
    blocks: dict[int, list[int]] = {}
    previous = 0  # "layer 1 if there is no previous full-attention layer" = start at previous + 1
    for f in sorted({int(f) for f in full_attention_layers}):
        blocks[f] = list(range(previous + 1, f)) or [f - 1]
        previous = f
    return blocks


# ---------------------------------------------------------------- massive-activations paper: spikes and plateaus


def received_attention(a: np.ndarray) -> np.ndarray:
    """The attention each token receives from later queries, averaged over heads: `[H, T, T]` -> `[T]`.

    `received[t] = mean_h sum_{q > t} A[h, q, t]` (rows = queries, columns = keys).
    """
    a = np.asarray(a, dtype=np.float64)
    # tril(k=-1) keeps A[q, t] for q > t; summing over q gives attention received from later queries.
    return np.tril(a, k=-1).sum(axis=-2).mean(axis=0)


def consensus_sink_of(received: Iterable[np.ndarray]) -> int:
    """`consensus_sink` from each full-attention layer's `received_attention` (one `[T]` array per layer)."""
    layers = [np.asarray(r, dtype=np.float64) for r in received]
    if not layers or layers[0].shape[-1] < 2:
        return -1
    T = layers[0].shape[-1]
    n_queries = np.arange(T - 1, 0, -1)  # T-1-t for t = 0..T-2
    score = np.sum(layers, axis=0)[: T - 1] / len(layers) / n_queries
    return int(np.argmax(score))


def consensus_sink(attentions: Iterable[np.ndarray]) -> int:
    """The token that receives the most attention from later queries.

    attentions: one `[H, T, T]` array (rows = queries, columns = keys) per
    full-attention layer. Score of token t: the attention it receives from
    queries `q > t`, averaged over layers and heads and divided by the number
    of such queries `T - 1 - t`. The last token has no later query and is not
    eligible. Returns -1 when there is no map or no eligible token (T < 2).
    """
    return consensus_sink_of(received_attention(a) for a in attentions)


def sink_spike_alignment(m: np.ndarray, full_attention_layers: Sequence[int]) -> float:
    """Fraction of full-attention layers f whose block maximum sits at f - 1.

    A hit is `argmax_{l in B_f} m[l] == f - 1` (ties go to the earlier layer, so
    a tie is not a hit). Averaging this over inputs gives the paper's rate,
    hits / (inputs x full-attention layers). NaN without attention layers or
    when m holds NaN.
    """
    m = np.asarray(m, dtype=np.float64)
    layers = _check_layers(m, full_attention_layers)
    if not layers or np.isnan(m).any():
        return NAN
    blocks = attention_blocks(layers)
    hits = [blocks[f][int(np.argmax(m[blocks[f]]))] == f - 1 for f in layers]
    return float(np.mean(hits))


def random_layer_baseline(full_attention_layers: Sequence[int]) -> float:
    """Expected alignment of a layer drawn uniformly from each block: mean of 1/|B_f|."""
    blocks = attention_blocks(full_attention_layers)
    if not blocks:
        return NAN
    return float(np.mean([1.0 / len(b) for b in blocks.values()]))


def peak_excess(m: np.ndarray, full_attention_layers: Sequence[int]) -> list[float]:
    """`log2(m[f-1] / max_{l in B_f, l < f-1} m[l])` per full-attention layer (sorted by f).

    +1 means the pre-attention position is twice the strongest earlier layer of
    its block. NaN when the block has one layer, or a magnitude is 0 (log undefined).
    """
    m = np.asarray(m, dtype=np.float64)
    layers = _check_layers(m, full_attention_layers)
    out = []
    for f, block in attention_blocks(layers).items():
        earlier = [position for position in block if position < f - 1]
        if not earlier:
            out.append(NAN)
            continue
        peak, reference = m[f - 1], m[earlier].max()
        out.append(float(np.log2(peak / reference)) if peak > 0 and reference > 0 else NAN)
    return out


def _inter_spike_terms(m: np.ndarray, full_attention_layers: Sequence[int]) -> list[tuple[float, float]] | None:
    """`(m[l], min(m[p_i], m[p_{i+1}]))` for every (i, l in J_i); None when ISR is undefined."""
    layers = _check_layers(m, full_attention_layers)
    if len(layers) < 2:
        return None
    attention = set(layers)
    terms = []
    for f, f_next in zip(layers[:-1], layers[1:]):
        p, p_next = f - 1, f_next - 1
        between = [position for position in range(p + 1, p_next) if position not in attention]
        if not between:
            return None
        terms += [(m[position], min(m[p], m[p_next])) for position in between]
    return terms


def inter_spike_retention(m: np.ndarray, full_attention_layers: Sequence[int]) -> float:
    """Mean over (i, l in J_i) of `min(1, m[l] / min(m[p_i], m[p_{i+1}]))`.

    `p_i = f_i - 1`; `J_i` = positions strictly between p_i and p_{i+1} that are
    not outputs of a full-attention layer. NaN with fewer than two
    full-attention layers, an empty J_i, or a zero endpoint.
    """
    m = np.asarray(m, dtype=np.float64)
    terms = _inter_spike_terms(m, full_attention_layers)
    if terms is None or any(floor <= 0 for _, floor in terms):
        return NAN
    return float(np.mean([min(1.0, value / floor) for value, floor in terms]))


def inter_spike_activation(m: np.ndarray, full_attention_layers: Sequence[int]) -> float:
    """`A_ISP`: the mean of m[l] over the same (i, l in J_i) as ISR, unnormalised; NaN where ISR's J_i is."""
    m = np.asarray(m, dtype=np.float64)
    terms = _inter_spike_terms(m, full_attention_layers)
    if terms is None:
        return NAN
    return float(np.mean([value for value, _ in terms]))


# ---------------------------------------------------------------- Gated Attention paper: sinks, activations, gates


def first_token_attention(attentions: Iterable[np.ndarray]) -> np.ndarray:
    """Mean attention on token 0 per layer and head, `[n_layers, H]`.

    Averages over queries q >= 1: query 0 can attend only to itself (weight 1
    under the causal mask), which says nothing about a sink. NaN when T < 2.
    """
    rows = []
    for a in attentions:
        a = np.asarray(a, dtype=np.float64)  # [H, T, T]
        rows.append(a[:, 1:, 0].mean(axis=-1) if a.shape[-1] > 1 else np.full(a.shape[0], NAN))
    return np.stack(rows) if rows else np.zeros((0, 0))


def first_token_importance(attentions: Iterable[np.ndarray]) -> np.ndarray:
    """Gu et al. 2024's importance of the first token per layer and head, `[n_layers, H]`: its mean attention
    weight over all T queries, q = 0..T-1 (*When Attention Sink Emerges in Language Models*, alpha_h^l(1)).

    Unlike `first_token_attention` this counts query 0 too, as their sink rate does: under a causal mask it attends
    to token 0 alone, so it adds `(1 - alpha) / T` to a head's score.
    """
    rows = [np.asarray(a, dtype=np.float64)[:, :, 0].mean(axis=-1) for a in attentions]  # [H, T, T] -> [H]
    return np.stack(rows) if rows else np.zeros((0, 0))


def sink_rate(importance: np.ndarray, epsilon: float = SINK_EPSILON) -> float:
    """Gu et al. 2024's sink rate: the fraction of heads whose `first_token_importance` exceeds `epsilon`, per
    layer, averaged over layers (their `Sink_1^epsilon`). importance: `[n_layers, H]`, NaN where a layer has fewer
    heads than another (left out of its layer's fraction). NaN without a layer."""
    importance = np.asarray(importance, dtype=np.float64)
    if importance.ndim != 2 or importance.shape[0] == 0:
        return NAN
    fractions = [float(np.mean(row[~np.isnan(row)] > epsilon)) for row in importance if (~np.isnan(row)).any()]
    return float(np.mean(fractions)) if fractions else NAN


def f_attn(attentions: Iterable[np.ndarray]) -> float:
    """F-Attn: mean attention weight on the first token over layers, heads and queries q >= 1."""
    per_layer_head = first_token_attention(attentions)
    return float(per_layer_head.mean()) if per_layer_head.size else NAN


def token_max_abs(residual: np.ndarray) -> np.ndarray:
    """`max_j |X[l][t, j]|` for every position and token: residual `[L+1, T, D]` -> `[L+1, T]`."""
    return np.abs(np.asarray(residual)).max(axis=-1)


def m_act_per_layer(residual: np.ndarray) -> np.ndarray:
    """Largest |hidden| of each residual state over tokens and channels: `[L+1, T, D]` -> `[L+1]`."""
    return token_max_abs(residual).max(axis=-1)


def m_act(residual: np.ndarray) -> float:
    """M-Act: mean over decoder layers l = 1..L of the largest |hidden| (X[0], the embeddings, excluded)."""
    per_layer = m_act_per_layer(residual)
    return float(per_layer[1:].mean()) if len(per_layer) > 1 else NAN


def gate_statistics(scores: np.ndarray, thresholds: Sequence[float] = GATE_THRESHOLDS) -> dict[str, float]:
    """Mean gate score and the fraction of scores below each threshold (default 0.1 and 0.5)."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if scores.size == 0:
        return {"mean": NAN, **{frac_below(t): NAN for t in thresholds}}
    return {"mean": float(scores.mean()), **{frac_below(t): float((scores < t).mean()) for t in thresholds}}


def gate_statistics_per_head(scores: np.ndarray, thresholds: Sequence[float] = GATE_THRESHOLDS) -> dict[str, np.ndarray]:
    """Same as `gate_statistics` per head: scores `[..., H, W]` -> arrays `[H]`."""
    scores = np.asarray(scores, dtype=np.float64)
    flat = np.moveaxis(scores, -2, 0).reshape(scores.shape[-2], -1)  # [H, N * W]
    out = {"mean": flat.mean(axis=1)}
    for t in thresholds:
        out[frac_below(t)] = (flat < t).mean(axis=1)
    return out


def scores_per_head(scores: np.ndarray) -> np.ndarray:
    """Gate scores `[B, T, H, W]` (or `[B, T, D]` for a dense gate: one "head") -> `[B*T, H, W]` float64."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 3:
        s = s[..., None, :]
    return s.reshape(-1, s.shape[-2], s.shape[-1])


def gate_summary(scores: np.ndarray, thresholds: Sequence[float] = GATE_THRESHOLDS) -> dict[str, np.ndarray]:
    """Sums from which gate statistics over any set of scores follow: scores `[N, H, W]` ->

    `n` `[H]` (scores per head), `sum` `[H]`, `below_<t>` `[H]` (count under each threshold) and
    `hist` `[len(GATE_BINS) - 1]` (clipped to [0, 1], so additive SiLU gates land in the edge bins).
    Summaries of several layers or inputs add key by key.
    """
    s = np.asarray(scores, dtype=np.float64)
    flat = np.moveaxis(s, -2, 0).reshape(s.shape[-2], -1)  # [H, N * W]
    out = {"n": np.full(flat.shape[0], float(flat.shape[1])), "sum": flat.sum(axis=1)}
    for t in thresholds:
        out[f"below_{t:g}"] = (flat < t).sum(axis=1).astype(np.float64)
    out["hist"] = np.histogram(np.clip(s, 0.0, 1.0), bins=GATE_BINS)[0].astype(np.float64)
    return out


def gate_statistics_of(summary: dict[str, np.ndarray], thresholds: Sequence[float] = GATE_THRESHOLDS) -> dict[str, float]:
    """`gate_statistics` of all the scores a (summed) `gate_summary` describes."""
    n = float(np.sum(summary["n"])) if summary else 0.0
    if n == 0:
        return gate_statistics([], thresholds)
    return {"mean": float(np.sum(summary["sum"])) / n, **{frac_below(t): float(np.sum(summary[f"below_{t:g}"])) / n for t in thresholds}}


# ---------------------------------------------------------------- uncertainty


def bootstrap_ci(
    values: Sequence[float], n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """`(mean, low, high)`: percentile bootstrap over inputs, NaNs dropped.

    With no defined value everything is NaN; with one, the interval is NaN
    (a single input says nothing about spread).
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return NAN, NAN, NAN
    if v.size == 1:
        return float(v[0]), NAN, NAN
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_resamples, v.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(v.mean()), float(low), float(high)
