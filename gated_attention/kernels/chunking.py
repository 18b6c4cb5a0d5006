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


def chunk_span(tensors: list[torch.Tensor], first: int, m: int, C: int) -> list[torch.Tensor]:
    """Chunks `first .. first + m - 1` of each `[B, T, H, D]` tensor as fp32 `[m, B * H, C, D]`, the last
    padded with zeros, and of each `[B, T, H]` tensor (one value per head: beta, a head's decay) as
    `[m, B * H, C]`."""
    span = slice(first * C, (first + m) * C)
    out = []
    for x in tensors:
        per_head = x.dim() == 3
        chunks = to_chunks(pad_time(x[:, span], m * C).unsqueeze(-1) if per_head else pad_time(x[:, span], m * C), m, C)
        out.append(chunks.squeeze(-1) if per_head else chunks)
    return out


def start_state(
    q: torch.Tensor, initial_state: torch.Tensor | None, BH: int, K: int, V: int
) -> torch.Tensor:
    """The recurrent state a chunked path starts from, fp32 `[B * H, K, V]`: `initial_state` or zeros."""
    if initial_state is None:
        return q.new_zeros(BH, K, V, dtype=torch.float32)
    return initial_state.to(torch.float32).reshape(BH, K, V)


def value_heads(q: torch.Tensor, k: torch.Tensor, HV: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[B, T, H, K]` repeated to the HV value heads (value head j reads q/k head j // (HV // H))."""
    H = q.shape[2]
    if HV == H:
        return q, k
    return q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)


def delta_rule_scan(
    out: torch.Tensor,
    state: torch.Tensor,
    first: int,
    u: torch.Tensor,
    w: torch.Tensor,
    attn: torch.Tensor,
    q_decayed: torch.Tensor,
    k_decayed: torch.Tensor,
    chunk_decay: torch.Tensor | None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The sequential part of a chunked delta rule over a group of chunks (the first being `first`), five small
    matmuls per chunk; each chunk's output goes straight into its place in `out` `[B, T, H, V]`. Returns the
    state `[B * H, K, V]` the group leaves.

    Per chunk i (`[m, B * H, ...]` operands): `u` `[C, V]` the values to write and `w` `[C, K]` the keys through
    which the old state is read, `attn` `[C, C]` the causal intra-chunk scores, `q_decayed` `[C, K]` reads the
    state, `k_decayed` `[K, C]` writes the next one, `chunk_decay` (None: no decay) decays it; `scale` multiplies
    the output.
    """
    B, _, H, V = out.shape
    C = u.shape[-2]
    for i in range(u.shape[0]):
        v_new = torch.baddbmm(u[i], w[i], state, alpha=-1)  # u - W S: the part S does not predict
        o = torch.baddbmm(torch.bmm(q_decayed[i], state), attn[i], v_new, beta=scale, alpha=scale)
        position = (first + i) * C
        out[:, position : position + C] = o.view(B, H, C, V).transpose(1, 2)
        state = torch.baddbmm(state if chunk_decay is None else state * chunk_decay[i], k_decayed[i], v_new)
    return state


def linear_attention_scan(
    out: torch.Tensor,
    state: torch.Tensor,
    first: int,
    scores: torch.Tensor,
    vc: torch.Tensor,
    q_decayed: torch.Tensor,
    k_decayed: torch.Tensor,
    chunk_decay: torch.Tensor,
) -> torch.Tensor:
    """The sequential part of a chunked decayed linear attention (GLA, simple GLA) over a group of chunks: per
    chunk i, `o = scores v + q_decayed S`, then `S = S * chunk_decay + k_decayed v`; as `delta_rule_scan`."""
    B, _, H, V = out.shape
    C = vc.shape[-2]
    for i in range(vc.shape[0]):
        o = torch.baddbmm(torch.bmm(scores[i], vc[i]), q_decayed[i], state)
        position = (first + i) * C
        out[:, position : position + C] = o.view(B, H, C, V).transpose(1, 2)
        state = torch.baddbmm(state * chunk_decay[i], k_decayed[i], vc[i])
    return state
