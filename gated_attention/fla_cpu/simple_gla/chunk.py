"""Simple gated linear attention (one decay per head and step), and RetNet's retention, in chunked torch.

Layout and meaning are fla's (`fla.ops.simple_gla`, `fla.ops.retention`). Per
head, with the state S `[K, V]` starting at `initial_state` (or zeros), for
t = 1..T:

    S_t = exp(g_t) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

g `[B, T, H]` is the log decay (g <= 0); `g_gamma` `[H]` is one constant log
decay per head instead (RetNet's retention is `g_gamma = log(1 - 2^(-5 - h))`);
neither means no decay (plain causal linear attention). `scale` defaults to
K ** -0.5. fla's reference is `fla/ops/simple_gla/naive.py`.

Chunked: within a chunk of C positions with c_i the log decay summed from
the chunk start, `o = (Q K^T * exp(c_i - c_j))_{j <= i} V + (Q exp(c)) S`
and `S <- exp(c_C) S + (K exp(c_C - c))^T V`, every exponent <= 0. The
sequential part is one small matmul per chunk.
"""

from __future__ import annotations

import math

import torch

from ...kernels.chunking import chunk_groups, chunk_length, chunk_span, linear_attention_scan, start_state
from ..chunking import empty_output, over_sequences

CHUNK_SIZE = 64


def retention_decay(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """RetNet's per-head log decay `[H]`: log(1 - 2^(-5 - h)), as fla's retention ops compute it."""
    return (1 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float, device=device))).log()


def torch_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run simple GLA over a sequence.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay, or None.
        g_gamma: `[H]` constant log decay, or None (at most one of g and g_gamma).
        scale: multiplies q; default K ** -0.5.
        initial_state: `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`), N = B or the number of packed sequences.
        output_final_state: also return the final state (fp32, same layout).
        state_v_first: fla's V-first state layout, which fla's layers use.
        cu_seqlens: `[N + 1]` bounds of packed sequences (B must be 1).

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in v's dtype; final_state or None.
    """
    if g is not None and g_gamma is not None:
        raise ValueError("give at most one of g and g_gamma")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if g is None:
        B, T, H = q.shape[:3]
        decay = g_gamma.float() if g_gamma is not None else q.new_zeros(H, dtype=torch.float32)
        g = decay.expand(B, T, H)
    return over_sequences(
        lambda q, k, v, g, h: _chunked(q, k, v, g, scale, h, output_final_state, chunk_size),
        [q, k, v, g], initial_state, output_final_state, state_v_first, cu_seqlens,
    )


def torch_retention(q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RetNet's multi-scale retention: `torch_simple_gla` with head h decaying by 1 - 2^(-5 - h)."""
    return torch_simple_gla(q, k, v, g_gamma=retention_decay(q.shape[2], q.device), **kwargs)


def _chunked(q, k, v, g, scale, initial_state, output_final_state, chunk_size):
    B, T, H, K = k.shape
    V = v.shape[-1]
    BH = B * H
    state = start_state(q, initial_state, BH, K, V)
    if T == 0:
        return empty_output(v, state, K, output_final_state)
    C, n = chunk_length(T, chunk_size)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    out = v.new_empty(B, n * C, H, V)
    for first, m in chunk_groups(n, BH * C * max(C, K, V)):
        # Padded steps have k = 0 (they write nothing) and g = 0 (they do not decay the state).
        qc, kc, vc, gc = chunk_span([q, k, v, g], first, m, C)  # [m, BH, C, D]; gc [m, BH, C]
        qc.mul_(scale)
        c = gc.cumsum(-1)  # [m, BH, C]
        # The upper triangle goes to -inf before exp, where c_i - c_j > 0 could overflow.
        decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill_(upper, -math.inf).exp_()  # [m, BH, C, C]
        scores = (qc @ kc.transpose(-1, -2)).mul_(decay)
        q_decayed = qc.mul_(c.exp().unsqueeze(-1))  # reads the state the previous chunks left
        k_decayed = (kc * (c[..., -1:] - c).exp().unsqueeze(-1)).transpose(-1, -2)  # [m, BH, K, C], writes the next
        chunk_decay = c[..., -1].exp()[..., None, None]  # [m, BH, 1, 1]
        state = linear_attention_scan(out, state, first, scores, vc, q_decayed, k_decayed, chunk_decay)
    return out[:, :T], state.view(B, H, K, V) if output_final_state else None
