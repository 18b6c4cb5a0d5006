"""Causal softmax attention that also returns its weights: what fla's `Attention` layer runs on the torch path.

fla's layer calls flash-attn (`flash_attn_func` / `flash_attn_varlen_func`),
which never materialises the attention weights. `softmax_attention` computes the
same attention in torch, scores and softmax in fp32, and returns the weights
`[B, HQ, T, S]` beside the output, so that an analysis can read them;
`flash_attention` and `flash_attention_varlen` take flash-attn's two calls as
fla's layer makes them.

Masking follows flash-attn's `causal=True`: the T queries are the last T of
the S key positions (a decode step or a continued prefill sees the whole
cache), with an optional sliding window (query at position p sees keys
p - window_size + 1 .. p), a 2-D padding mask `[B, S]` (1 = token; flash-attn
gets it through unpadding), or packed sequences (`cu_seqlens`, B = 1) that see
only themselves. A query that sees no key (a padding position) gets zero
weights and a zero output, as flash-attn's re-padding leaves it.
"""

from __future__ import annotations

import math

import torch


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[B, T, HQ, D]`, k and v `[B, S, H, D]` (HQ a multiple of H) -> (o `[B, T, HQ, D]` in q's dtype,
    weights `[B, HQ, T, S]` in fp32)."""
    B, T, HQ, D = q.shape
    S, H = k.shape[1], k.shape[2]
    if scale is None:
        scale = D ** -0.5
    if HQ != H:  # query head h reads key/value head h // (HQ // H), as flash-attn groups them
        k, v = k.repeat_interleave(HQ // H, dim=2), v.repeat_interleave(HQ // H, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.to(torch.float32), k.to(torch.float32)) * scale
    visible = _visible(B, T, S, window_size, attention_mask, cu_seqlens, q.device)  # [B, T, S]
    scores = scores.masked_fill(~visible.unsqueeze(1), -math.inf)
    weights = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1)[:, None, :, None], 0.0)
    o = torch.einsum("bhts,bshd->bthd", weights, v.to(torch.float32))
    return o.to(q.dtype), weights


def _visible(B, T, S, window_size, attention_mask, cu_seqlens, device) -> torch.Tensor:
    query_position = torch.arange(S - T, S, device=device).unsqueeze(-1)  # [T, 1]
    key_position = torch.arange(S, device=device)  # [S]
    visible = key_position <= query_position  # [T, S]
    if window_size is not None:
        visible = visible & (key_position > query_position - window_size)
    visible = visible.expand(B, T, S)
    if cu_seqlens is not None:
        sequence = torch.searchsorted(cu_seqlens[1:].to(device), key_position, right=True)  # [S]
        visible = visible & (sequence[-T:].unsqueeze(-1) == sequence)
    if attention_mask is not None:
        token = attention_mask[:, -S:].to(device=device, dtype=torch.bool)  # [B, S]
        visible = visible & token.unsqueeze(1) & token[:, -T:].unsqueeze(-1)
    return visible


def _window(causal: bool, window_size: tuple[int, int]) -> int | None:
    """flash-attn's `(left, right)` window of a causal call -> how many keys a query sees, itself included."""
    left, right = window_size
    if not causal or right not in (-1, 0):
        raise NotImplementedError(f"flash-attn's attention on the torch path is causal only (causal={causal}, "
                                  f"window_size={window_size})")
    return None if left < 0 else left + 1


def flash_attention(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's `flash_attn_func`: q `[B, T, HQ, D]`, k and v `[B, S, H, D]` -> (o `[B, T, HQ, D]`, weights
    `[B, HQ, T, S]`)."""
    if dropout_p:
        raise NotImplementedError("flash-attn's attention on the torch path: dropout is not implemented")
    return softmax_attention(q, k, v, scale=softmax_scale, window_size=_window(causal, window_size))


def flash_attention_varlen(
    q, k, v, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """flash-attn's `flash_attn_varlen_func`: sequences packed along dim 0, q `[Nq, HQ, D]`, k and v
    `[Nk, H, D]`, sequence i at rows `cu_seqlens_q[i]:cu_seqlens_q[i + 1]` of q and `cu_seqlens_k[i]:...` of
    k -> (o `[Nq, HQ, D]`, the weights of each sequence alone `[HQ, Tq_i, Sk_i]`)."""
    if dropout_p:
        raise NotImplementedError("flash-attn's attention on the torch path: dropout is not implemented")
    window = _window(causal, window_size)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outputs, weights = [], []
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        o, w = softmax_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale=softmax_scale,
                                 window_size=window)
        outputs.append(o[0])
        weights.append(w[0])
    return torch.cat(outputs), weights
