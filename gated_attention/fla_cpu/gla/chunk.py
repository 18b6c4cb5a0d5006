"""Gated linear attention (a decay per key channel and step), in chunked torch; HGRN2 runs on it too.

Layout and meaning are fla's (`fla.ops.gla`). Per head, with the state S
`[K, V]` starting at `initial_state` (or zeros), for t = 1..T:

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

g `[B, T, H, K]` is the log decay of each key channel (g <= 0), `scale`
defaults to K ** -0.5. fla's reference is `fla/ops/gla/naive.py`
(`naive_recurrent_gla`).

Chunked like `simple_gla`, except that the decay between positions j <= i,
exp(c_i - c_j), now differs per key channel and cannot be one [C, C] matrix
beside `Q K^T`. `decayed_scores` factors it through the chunk's first
position, `(q exp(c - c_0)) . (k exp(c_0 - c))`, one matmul whose factors
stay within fp32's range as long as no channel decays by more than
exp(-SPAN_LIMIT) within the chunk: the chunk length is chosen for that
(`chunking.chunk_size_for_decay`, 64 down to 16 positions). Only a decay
faster still (beyond e^-2.5 a step on average over 16 steps) takes the exact
form, the scores summed channel by channel, at K times the memory.
"""

from __future__ import annotations

import math

import torch

from ...kernels.chunking import chunk_groups, chunk_span, linear_attention_scan, start_state
from ..chunking import chunk_size_for_decay, cumsum_rows, empty_output, over_sequences

CHUNK_SIZE = 64
SMALLEST_CHUNK = 16
# Factors up to exp(40) ~ 2e17 leave fp32 room for |q k| up to ~1e21 before the dropped entries overflow.
SPAN_LIMIT = 40.0


def decayed_scores(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, strict: bool = False, factored: bool = True
) -> torch.Tensor:
    """`A[i, j] = sum_d a[i, d] b[j, d] exp(c[i, d] - c[j, d])` for j <= i (j < i if strict), 0 above.

    a, b, c: `[..., C, K]`, c non-increasing along C (a cumulative log decay). Returns `[..., C, C]`.
    `factored`: one matmul through the first row, `(a exp(c - c_0)) @ (b exp(c_0 - c))^T`, for
    `c_0 - c_last <= SPAN_LIMIT` in every channel (the entries above the diagonal, which may be large,
    are dropped); otherwise the sum channel by channel, the exponents above the diagonal at -inf before exp.
    """
    C = a.shape[-2]
    above = torch.ones(C, C, dtype=torch.bool, device=a.device).triu(0 if strict else 1)
    if factored:
        relative = c - c[..., :1, :]  # <= 0
        scores = (a * relative.exp()) @ (b * relative.neg().exp_()).transpose(-1, -2)
        return scores.masked_fill_(above, 0.0)
    exponent = (c.unsqueeze(-2) - c.unsqueeze(-3)).masked_fill_(above.unsqueeze(-1), -math.inf).exp_()
    return (exponent.mul_(a.unsqueeze(-2)).mul_(b.unsqueeze(-3))).sum(-1)


def torch_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run gated linear attention over a sequence.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]` log decay per key channel.
        scale: multiplies q; default K ** -0.5.
        initial_state: `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`), N = B or the number of packed sequences.
        output_final_state: also return the final state (fp32, same layout).
        state_v_first: fla's V-first state layout, which fla's layers use.
        cu_seqlens: `[N + 1]` bounds of packed sequences (B must be 1).
        chunk_size: the longest chunk; shorter where the decay is fast (see the module's docstring).

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in v's dtype; final_state or None.
    """
    if scale is None:
        scale = k.shape[-1] ** -0.5
    return over_sequences(
        lambda q, k, v, g, h: _chunked(q, k, v, g, scale, h, output_final_state, chunk_size),
        [q, k, v, g], initial_state, output_final_state, state_v_first, cu_seqlens,
    )


def _chunked(q, k, v, g, scale, initial_state, output_final_state, chunk_size):
    B, T, H, K = k.shape
    V = v.shape[-1]
    BH = B * H
    state = start_state(q, initial_state, BH, K, V)
    if T == 0:
        return empty_output(v, state, K, output_final_state)
    C, factored = chunk_size_for_decay(g, chunk_size, SPAN_LIMIT, SMALLEST_CHUNK)
    n = -(-T // C)
    out = v.new_empty(B, n * C, H, V)
    for first, m in chunk_groups(n, BH * C * max(C, K, V) * (1 if factored else K)):
        # Padded steps have k = 0 (they write nothing) and g = 0 (they do not decay the state).
        qc, kc, vc, gc = chunk_span([q, k, v, g], first, m, C)  # [m, BH, C, D]
        qc.mul_(scale)
        c = cumsum_rows(gc)  # log decay since the chunk start, per key channel
        scores = decayed_scores(qc, kc, c, factored=factored)  # [m, BH, C, C], causal
        q_decayed = qc.mul_(c.exp())  # reads the state the previous chunks left
        k_decayed = (kc * (c[..., -1:, :] - c).exp_()).transpose(-1, -2)  # [m, BH, K, C], writes the next one
        chunk_decay = c[..., -1, :].exp().unsqueeze(-1)  # [m, BH, K, 1]
        state = linear_attention_scan(out, state, first, scores, vc, q_decayed, k_decayed, chunk_decay)
    return out[:, :T], state.view(B, H, K, V) if output_final_state else None
