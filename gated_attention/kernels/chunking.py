"""What every chunked linear-attention path here shares: chunk sizes, the chunk layout, packed sequences.

fla's layout throughout: `[B, T, H, D]` in, `[B, T, H, D]` out. Inside, a
sequence is cut into `n` chunks of `C` positions and laid out chunk-major,
`[n, B * H, C, D]` in fp32, so that chunk i is one contiguous batch of `[C, D]`
matrices for `torch.bmm`. The last chunk is padded with zeros; each op says
why its zero padding changes neither the outputs nor the final state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def chunk_length(T: int, chunk_size: int) -> tuple[int, int]:
    """`(C, n)`: the chunk length and count for T positions.

    A short input (a decode step, a short prompt) is one short chunk, not a
    chunk padded to `chunk_size`. C is a power of two, as
    `gated_delta_rule.unit_lower_inverse` and the sub-blocks of `gla.decayed_scores` need.
    """
    C = min(chunk_size, 1 << max(T - 1, 0).bit_length())
    return C, math.ceil(T / C)


def pad_time(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of `[B, T, ...]` to `length`."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def to_chunks(x: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """`[B, T, H, D]` (T = n * chunk) -> fp32 `[n, B * H, chunk, D]`, chunk-major so chunk i is contiguous."""
    B, _, H, D = x.shape
    out = x.new_empty(n, B, H, chunk, D, dtype=torch.float32)
    out.copy_(x.reshape(B, n, chunk, H, D).permute(1, 0, 3, 2, 4))  # one copy, converting the dtype on the way
    return out.view(n, B * H, chunk, D)


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.cumsum(-2)` for `[..., C, D]`, as one matmul with a lower-triangular matrix of ones.

    torch's CPU cumsum along a dimension that is not the last one walks the
    strides element by element, several times slower than this small matmul
    (which sums the same fp32 terms, so its rounding is of the same size).
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


def each_sequence(
    run: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor,
    per_position: list[torch.Tensor | None],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed sequences (`cu_seqlens`, batch 1): `run(*slices, initial_state)` on each alone, as fla runs them.

    `per_position` are `[1, T, ...]` tensors (None passes through); state i is
    `initial_state[i]`; no state flows from one sequence into the next.
    """
    if per_position[0].shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {per_position[0].shape[0]}")
    bounds = cu_seqlens.tolist()
    outputs, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces = [None if x is None else x[:, start:end] for x in per_position]
        o, s = run(*pieces, None if initial_state is None else initial_state[i : i + 1])
        outputs.append(o)
        states.append(s)
    return torch.cat(outputs, dim=1), torch.cat(states) if output_final_state else None
