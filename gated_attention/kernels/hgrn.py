"""HGRN's gated linear recurrence, in chunked torch.

Layout and meaning are fla's (`fla.ops.hgrn`). Per channel, with h starting at
`initial_state` (or zeros), for t = 1..T:

    h_t = exp(g_t) h_{t-1} + x_t,    o_t = h_t

x, g: `[B, T, D]`, g the log forget gate (g <= 0). fla's reference is
`fla/ops/hgrn/naive.py` (`naive_recurrent_hgrn`).

Chunked: the sequence is cut into blocks of s positions, s the longest power
of two (at most 64) over which no channel decays by more than exp(-40).
Within a block, with c the log decay since the block's first position,
`h_i = exp(c_i) cumsum_j(exp(-c_j) x_j) + exp(c_i + g_first) h_before`: the
factors exp(-c_j) stay below exp(40), and the cumulative sum's rounding is
relative to its largest, most recent term. The blocks are then joined by a
scan of the maps h -> A h + b over blocks, composed in log2(number of blocks)
doubling steps; decays are only multiplied there, so nothing can overflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunking import chunk_length, cumsum_rows, each_sequence, pad_time

CHUNK_SIZE = 64
# exp(40) ~ 2e17: room to spare in fp32 for the factors exp(-c) of a block.
SPAN_LIMIT = 40.0
PIECE_ELEMENTS = 1 << 16  # 256 KB of fp32


def torch_hgrn(
    x: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the HGRN recurrence.

    Args:
        x, g: `[B, T, D]`.
        initial_state: `[N, D]`, N = B or the number of packed sequences.
        output_final_state: also return the final state `[N, D]` (fp32).
        cu_seqlens: `[N + 1]` bounds of packed sequences (B must be 1).

    Returns:
        `(o, final_state)`: o `[B, T, D]` in x's dtype; final_state or None.
    """
    def run(x, g, h):
        return _chunked(x, g, h, output_final_state, chunk_size)

    if cu_seqlens is not None:
        return each_sequence(run, cu_seqlens, [x, g], initial_state, output_final_state)
    return run(x, g, initial_state)


def _chunked(x, g, initial_state, output_final_state, chunk_size):
    B, T, D = x.shape
    h = x.new_zeros(B, D, dtype=torch.float32) if initial_state is None else initial_state.to(torch.float32)
    if T == 0:
        return x.new_empty(B, 0, D), h if output_final_state else None
    s, _ = chunk_length(T, chunk_size)
    while s > 1 and _largest_span(g, s) > SPAN_LIMIT:
        s //= 2
    # Pieces of several blocks, each one temporary of about PIECE_ELEMENTS floats: large fresh
    # allocations cost more than the arithmetic on them (page faults), so the pieces are taken
    # one after the other, the state h carried from one to the next.
    piece = s * max(1, PIECE_ELEMENTS // (s * B * D))
    out = x.new_empty(B, T, D)
    for start in range(0, T, piece):
        end = min(T, start + piece)
        s_here, m = chunk_length(end - start, s)
        # Padded steps have x = 0 and g = 0: they leave h as it is.
        xp, gp = (pad_time(t[:, start:end].to(torch.float32), m * s_here).reshape(B, m, s_here, D) for t in (x, g))
        first = gp[:, :, :1]
        c = cumsum_rows(gp).sub_(first)  # [B, m, s, D]: log decay since each block's first position, <= 0
        local = cumsum_rows(c.neg().exp_().mul_(xp))  # exp(-c) x, summed
        into = c.exp_()
        local.mul_(into)  # each block run from a zero state
        into.mul_(first.exp())  # what is left at position i of the state the block started from
        # Join the blocks: h_end[b] = into_end[b] h_end[b - 1] + local_end[b], from the piece's h.
        a, b = into[:, :, -1], local[:, :, -1].clone()  # [B, m, D]
        b[:, 0].addcmul_(a[:, 0], h)
        shift = 1
        while shift < m:  # afterwards, block j holds the map of blocks j - 2 * shift + 1 .. j
            b = torch.addcmul(b, a, F.pad(b, (0, 0, shift, 0))[:, :m])
            a = a * F.pad(a, (0, 0, shift, 0), value=1.0)[:, :m]
            shift *= 2
        h_before = torch.cat([h.unsqueeze(1), b[:, :-1]], dim=1)  # [B, m, D]: the state each block starts from
        local.addcmul_(into, h_before.unsqueeze(2))
        out[:, start:end] = local.view(B, m * s_here, D)[:, : end - start]
        h = b[:, -1]
    return out, h.clone() if output_final_state else None


def _largest_span(g: torch.Tensor, s: int) -> float:
    """The largest log decay of any channel over the positions after the first of a block of s (a host sync)."""
    B, T, D = g.shape
    n = -(-T // s)
    blocks = pad_time(g.to(torch.float32), n * s).reshape(B, n, s, D)[:, :, 1:]
    return -blocks.sum(2).min().item() if s > 1 else 0.0
