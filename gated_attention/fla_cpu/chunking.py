"""What the chunked paths of fla's ops here add to `kernels.chunking`: chunk lengths under a decay per
channel, a cumulative sum as one matmul, and fla's layout of a recurrent state.

The chunk layout itself (`[n, B * H, C, D]`, chunk groups, padding, packed
sequences) is `kernels.chunking`'s, shared with the package's own gated delta rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.chunking import chunk_length, each_sequence, pad_time


def chunk_size_for_decay(g: torch.Tensor, chunk_size: int, limit: float, smallest: int) -> tuple[int, bool]:
    """`(C, within)`: the longest chunk length C (a power of two, at most `chunk_size` and the padded T, at
    least `smallest`) over which no channel of the log decay g `[B, T, ...]` (g <= 0) falls by more than
    `limit` after a chunk's first position; `within` is False where even `smallest` positions fall further.

    Paths with a decay per channel write the decay between positions j <= i of a chunk as
    `exp(c_i - c_0) * exp(c_0 - c_j)`, which stays in fp32's range only while that fall is bounded.
    Measuring costs one pass over g per halving, and a host sync.
    """
    T = g.shape[1]
    C, _ = chunk_length(T, chunk_size)
    while True:
        n = -(-T // C)
        blocks = pad_time(g.to(torch.float32), n * C).unflatten(1, (n, C))
        fall = -blocks[:, :, 1:].sum(2).min().item() if C > 1 else 0.0
        if fall <= limit:
            return C, True
        if C <= smallest:
            return C, False
        C //= 2


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.cumsum(-2)` for `[..., C, D]`, as one matmul with a lower-triangular matrix of ones.

    torch's CPU cumsum along a dimension that is not the last one walks the
    strides element by element; the matmul is one batched call, and sums the
    same fp32 terms, so its rounding is of the same size.
    """
    C = x.shape[-2]
    return torch.ones(C, C, dtype=x.dtype, device=x.device).tril_() @ x


def state_in(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """An initial state in fla's layout (`[N, H, V, K]` when `state_v_first`) -> fp32 `[N, H, K, V]`."""
    if state is None:
        return None
    state = state.to(torch.float32)
    return state.transpose(-1, -2) if state_v_first else state


def state_out(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """A final state `[N, H, K, V]` -> fla's layout, contiguous."""
    if state is None:
        return None
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def over_sequences(
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    per_position: list[torch.Tensor],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked(*per_position, state)` over the batch, or over each packed sequence of `cu_seqlens` alone, with
    the initial and final states in fla's layout (`state_in` / `state_out`)."""
    h0 = state_in(initial_state, state_v_first)
    if cu_seqlens is not None:
        o, state = each_sequence(chunked, cu_seqlens, per_position, h0, output_final_state)
    else:
        o, state = chunked(*per_position, h0)
    return o, state_out(state, state_v_first)


def empty_output(v: torch.Tensor, state: torch.Tensor, K: int, output_final_state: bool):
    """What a chunked path returns for T = 0: no output positions `[B, 0, H, V]`, the state unchanged."""
    B, _, H, V = v.shape
    return v.new_empty(B, 0, H, V), state.view(B, H, K, V) if output_final_state else None
