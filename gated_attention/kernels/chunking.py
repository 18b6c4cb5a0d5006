"""What every chunked linear-attention path shares: chunk sizes, the chunk layout, packed sequences; the
gated delta rule here and the torch paths of fla's other ops (`fla_cpu`) are cut by it.

fla's layout throughout: `[B, T, H, D]` in, `[B, T, H, D]` out. Inside, a
sequence is cut into `n` chunks of `C` positions and laid out chunk-major,
`[n, B * H, C, D]` in fp32, so that chunk i is one contiguous batch of `[C, D]`
matrices for `torch.bmm`; the chunks are taken a few at a time
(`chunk_groups`), so that temporaries stay small. The last chunk is padded with zeros; each op says
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
    chunk padded to `chunk_size`. C is a power of two, so that the paths that shorten
    their chunks for fast decays (`fla_cpu.chunking.chunk_size_for_decay`) can halve it.
    """
    C = min(chunk_size, 1 << max(T - 1, 0).bit_length())
    return C, math.ceil(T / C)


# The largest temporary a chunked path builds at once, in fp32 elements (256 KB). Chunks are taken a group
# at a time, so that no temporary outgrows this: a large fresh allocation can cost more than the arithmetic
# done on it (the kernel maps and zeroes its pages on first touch), while a small one comes back from the
# allocator's free lists.
GROUP_ELEMENTS = 1 << 16


def chunk_groups(n: int, elements_per_chunk: int) -> list[tuple[int, int]]:
    """`(first chunk, count)` of consecutive groups of the n chunks, each group's largest temporary at
    most `GROUP_ELEMENTS` (one chunk at the least)."""
    size = max(1, GROUP_ELEMENTS // max(1, elements_per_chunk))
    return [(first, min(size, n - first)) for first in range(0, n, size)]


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
