"""fla's rotary embedding (`fla.modules.rotary.rotary_embedding`) in torch.

x `[B, T, H, D]`; cos, sin `[TR, R / 2]`, the tables of `RotaryEmbedding`
(R <= D; channels from R on pass through unchanged). Position t of
sequence n is `t + seqlen_offsets` (an int, or one offset per sequence `[N]`);
with `cu_seqlens` (B = 1) positions count from each packed sequence's start.
Non-interleaved (GPT-NeoX) pairs channel i with i + R / 2, interleaved (GPT-J)
pairs 2i with 2i + 1:

    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)

Computed in fp32, returned in x's dtype, as fla's kernel does; a position
outside the tables (negative under left padding) gets zeros in its rotated
channels, as in fla's kernel. fla's own torch twin is `rotary_embedding_ref`.
"""

from __future__ import annotations

import torch


def torch_rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate x; arguments as fla's `rotary_embedding` (`chunk_indices` is a kernel detail and unused)."""
    B, T, H, D = x.shape
    TR, half = cos.shape
    R = 2 * half
    positions = torch.arange(T, device=x.device).expand(B, T)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].to(x.device)
        sequence = torch.searchsorted(cu_seqlens[1:].to(x.device), positions[0], right=True)  # [T]
        positions = (positions[0] - starts[sequence]).unsqueeze(0)
        offsets = seqlen_offsets[sequence].unsqueeze(0) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    else:
        offsets = seqlen_offsets.view(B, 1) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    positions = positions + offsets  # [B, T]
    inside = (positions >= 0) & (positions < TR)
    index = positions.clamp(0, TR - 1)
    c = cos.to(torch.float32)[index].unsqueeze(2)  # [B, T, 1, R / 2]
    s = sin.to(torch.float32)[index].unsqueeze(2)
    rotated = x[..., :R].to(torch.float32)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    rotated = rotated * inside[..., None, None]
    out = x if inplace else torch.empty_like(x)
    out[..., :R] = rotated.to(x.dtype)
    if R < D and not inplace:
        out[..., R:] = x[..., R:]
    return out
