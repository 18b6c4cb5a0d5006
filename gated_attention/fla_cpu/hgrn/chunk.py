"""HGRN's gated linear recurrence, in chunked torch.

Layout and meaning are fla's (`fla.ops.hgrn`). Per channel, with h starting at
`initial_state` (or zeros), for t = 1..T:

    h_t = exp(g_t) h_{t-1} + x_t,    o_t = h_t

x, g: `[B, T, D]`, g the log forget gate (g <= 0). fla's reference is
`fla/ops/hgrn/naive.py` (`naive_recurrent_hgrn`).

Chunked: the sequence is cut into blocks of C positions (32), and the
recurrence runs position by position *within* every block at once, each
step one fused multiply-add over all blocks (`h = a h + x`, a = exp(g), in
the reference's order); beside it, the running product of a gives each
position's decay since its block began. The blocks are then joined by a scan of the
maps h -> A h + b over blocks, composed in log2(number of blocks) doubling
steps, and each position adds its decayed share of the state its block
started from. Decays are only multiplied, never divided: nothing can
overflow, whatever the gates. That is C + log2(T / C) steps of torch ops
where the reference takes T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.chunking import chunk_length, each_sequence, pad_time

CHUNK_SIZE = 32


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
    h0 = x.new_zeros(B, D, dtype=torch.float32) if initial_state is None else initial_state.to(torch.float32)
    if T == 0:
        return x.new_empty(B, 0, D), h0 if output_final_state else None
    C, n = chunk_length(T, chunk_size)
    # Padded steps have x = 0 and g = 0 (a = 1): they leave h as it is.
    xs, gs = (pad_time(t, n * C).view(B, n, C, D) for t in (x, g))
    xs, a = xs.to(torch.float32), gs.to(torch.float32).exp()  # one op each, not one a step
    # Step t of every block at once: out[:, :, t] is each block's h from a zero state, decays[:, :, t] the decay
    # since the block began (a running product, kept here step by step: torch.cumprod over a dimension that is
    # not the last walks its strides element by element). Each step is one fused multiply-add and one multiply
    # over a [B, n, D] slice.
    out = torch.empty(B, n, C, D, dtype=torch.float32, device=x.device)
    decays = torch.empty_like(out)
    out[:, :, 0], decays[:, :, 0] = xs[:, :, 0], a[:, :, 0]
    for t in range(1, C):
        torch.addcmul(xs[:, :, t], a[:, :, t], out[:, :, t - 1], out=out[:, :, t])
        torch.mul(a[:, :, t], decays[:, :, t - 1], out=decays[:, :, t])
    # Join the blocks: h_end[j] = a_end[j] h_end[j - 1] + local_end[j], from h_end[-1] = h0.
    A, H = decays[:, :, -1], out[:, :, -1].clone()  # [B, n, D]
    H[:, 0].addcmul_(A[:, 0], h0)
    shift = 1
    while shift < n:  # afterwards, block j holds the map of blocks j - 2 * shift + 1 .. j
        H = torch.addcmul(H, A, F.pad(H, (0, 0, shift, 0))[:, :n])
        A = A * F.pad(A, (0, 0, shift, 0), value=1.0)[:, :n]
        shift *= 2
    h_before = torch.cat([h0.unsqueeze(1), H[:, :-1]], dim=1)  # [B, n, D]: the state each block starts from
    out.addcmul_(decays, h_before.unsqueeze(2))  # each position's decayed share of it
    return out.view(B, n * C, D)[:, :T].to(x.dtype), H[:, -1].clone() if output_final_state else None
