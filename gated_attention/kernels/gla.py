"""Gated linear attention (a decay per key channel and step), in chunked torch; HGRN2 runs on it too.

Layout and meaning are fla's (`fla.ops.gla`). Per head, with the state S
`[K, V]` starting at `initial_state` (or zeros), for t = 1..T:

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

g `[B, T, H, K]` is the log decay of each key channel (g <= 0), `scale`
defaults to K ** -0.5. fla's reference is `fla/ops/gla/naive.py`
(`naive_recurrent_gla`).

Chunked like `simple_gla`, except that the decay between positions j <= i,
exp(c_i - c_j), now differs per key channel and cannot be factored out of
the score `sum_d q_id k_jd exp(c_id - c_jd)` as one [C, C] matrix. Writing it
as `(q exp(c)) . (k exp(-c))` would overflow (exp(-c) grows without bound
along a chunk). `decayed_scores` instead splits a chunk into sub-blocks of 16
positions, as fla's kernels do: between blocks, both factors are taken
relative to the first position of the query block, so every exponent is
<= 0; within a block, the 16 x 16 scores are summed channel by channel.
"""

from __future__ import annotations

import math

import torch

from .chunking import chunk_length, cumsum_rows, each_sequence, pad_time, state_in, state_out, to_chunks

CHUNK_SIZE = 64
SUB_BLOCK = 16
# Factors up to exp(40) ~ 2e17 leave fp32 room for |q k| up to ~1e21 before the dropped entries overflow.
SPAN_LIMIT = 40.0


def decayed_scores(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
    """`A[i, j] = sum_d a[i, d] b[j, d] exp(c[i, d] - c[j, d])` for j <= i (j < i if strict), 0 above.

    a, b, c: `[..., C, K]`, C a power of two; c non-increasing along C (a cumulative log decay).
    Returns `[..., C, C]`.

    The chunk is cut into blocks of s positions, s the longest power of two
    (at least `SUB_BLOCK`, at most C) over which no channel decays by more
    than exp(-`SPAN_LIMIT`). Within a block, relative to c at its first row
    r: `(a exp(c - r)) @ (b exp(r - c))^T`, one matmul whose factors stay
    within exp(+-SPAN_LIMIT) (the entries above the diagonal, which may be
    large, are dropped). Between blocks, relative to c at the query block's
    first row, every exponent is <= 0. Only where a channel decays faster than
    that within `SUB_BLOCK` steps are a block's scores summed channel by
    channel, exactly and at sixteen times the cost.
    """
    *batch, C, K = a.shape
    s = C
    while s > SUB_BLOCK and _largest_span(c, s) > SPAN_LIMIT:
        s //= 2
    s = min(s, C)
    m = C // s
    exact_within = _largest_span(c, s) > SPAN_LIMIT
    r = c[..., ::s, :].unsqueeze(-2)  # [..., m, 1, K]: c at each block's first row
    a_relative = a.unflatten(-2, (m, s)) * (c.unflatten(-2, (m, s)) - r).exp()  # [..., m, s, K], exponents <= 0
    above = torch.ones(s, s, dtype=torch.bool, device=a.device).triu(0 if strict else 1)
    if exact_within:
        cd = c.unflatten(-2, (m, s))
        exponent = (cd.unsqueeze(-2) - cd.unsqueeze(-3)).masked_fill(above.unsqueeze(-1), -math.inf)
        within = (exponent.exp() * a.unflatten(-2, (m, s)).unsqueeze(-2) * b.unflatten(-2, (m, s)).unsqueeze(-3)).sum(-1)
    else:
        b_relative = b.unflatten(-2, (m, s)) * (r - c.unflatten(-2, (m, s))).exp()  # exponents in [0, SPAN_LIMIT]
        within = (a_relative @ b_relative.transpose(-1, -2)).masked_fill_(above, 0.0)  # [..., m, s, s]
    if m == 1:
        return within.view(*batch, C, C)

    # Keys before the query block I, relative to r_I: r_I - c_j <= 0. Keys at or after I's
    # first row get -inf before exp, where their exponent could be positive and overflow.
    before = torch.arange(C, device=a.device) < (torch.arange(m, device=a.device) * s).unsqueeze(-1)  # [m, C]
    exponent = (r - c.unsqueeze(-3)).masked_fill(~before.unsqueeze(-1), -math.inf)  # [..., m, C, K]
    scores = a_relative @ (b.unsqueeze(-3) * exponent.exp()).transpose(-1, -2)  # [..., m, s, C], 0 from I's first column
    blocks = scores.view(*batch, m, s, m, s)
    blocks.diagonal(dim1=-4, dim2=-2).add_(within.movedim(-3, -1))  # the diagonal blocks, [..., s, s, m]
    return scores.view(*batch, C, C)


def _largest_span(c: torch.Tensor, s: int) -> float:
    """The largest log decay of any channel over blocks of s positions of c `[..., C, K]` (a host sync)."""
    blocks = c.unflatten(-2, (c.shape[-2] // s, s))
    return (blocks[..., 0, :] - blocks[..., -1, :]).max().item()


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

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in v's dtype; final_state or None.
    """
    if scale is None:
        scale = k.shape[-1] ** -0.5
    h0 = state_in(initial_state, state_v_first)
    if cu_seqlens is not None:
        o, state = each_sequence(
            lambda q, k, v, g, h: _chunked(q, k, v, g, scale, h, output_final_state, chunk_size),
            cu_seqlens, [q, k, v, g], h0, output_final_state,
        )
    else:
        o, state = _chunked(q, k, v, g, scale, h0, output_final_state, chunk_size)
    return o, state_out(state, state_v_first)


def _chunked(q, k, v, g, scale, initial_state, output_final_state, chunk_size):
    B, T, H, K = k.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    state = q.new_zeros(B * H, K, V, dtype=torch.float32) if initial_state is None else initial_state.reshape(B * H, K, V)
    if T == 0:
        return v.new_empty(B, 0, H, V), state.view(B, H, K, V) if output_final_state else None
    # Padded steps have k = 0 (they write nothing) and g = 0 (they do not decay the state).
    C, n = chunk_length(T, chunk_size)
    q, k, v, g = (to_chunks(pad_time(x, n * C), n, C) for x in (q, k, v, g))  # [n, BH, C, D]
    q = q * scale
    c = cumsum_rows(g)  # log decay since the chunk start, per key channel
    out = decayed_scores(q, k, c) @ v  # intra-chunk part, [n, BH, C, V]
    q_decayed = q * c.exp()  # reads the state the previous chunks left
    k_decayed = (k * (c[..., -1:, :] - c).exp()).transpose(-1, -2)  # [n, BH, K, C], writes the next one
    chunk_decay = c[..., -1, :].exp().unsqueeze(-1)  # [n, BH, K, 1]
    for i in range(n):
        out[i].baddbmm_(q_decayed[i], state)
        state = torch.baddbmm(state * chunk_decay[i], k_decayed[i], v[i])
    o = out.view(n, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(out_dtype), state.view(B, H, K, V) if output_final_state else None
