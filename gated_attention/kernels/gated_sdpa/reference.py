"""Plain-torch gated SDPA: the reference for the Triton kernels and the fallback everywhere else.

    o = softmax(q k^T * scale + mask) v * act(gate)

With `sinks` (`[HQ]`, GPT-OSS's learned per-head logit s_h, one more term in
every row's softmax denominator with no value) the attention output is scaled
by `sigmoid(lse_t - s_h)`, the share of the row the keys keep, with lse the
row's log-sum-exp over the keys it sees.

Shapes: q `[B, T, HQ, D]`, k/v `[B, S, HKV, D]` with HQ a multiple of HKV (query
head h reads key/value head `h // (HQ / HKV)`), gate `[B, T, HQ, D]`
(elementwise) or `[B, T, HQ]` (headwise) holding pre-activation logits; output
`[B, T, HQ, D]`. With `cu_seqlens` (int `[N+1]`, flash-attn's convention) B is
1, T == S, and sequence n is tokens `cu_seqlens[n]:cu_seqlens[n+1]`, attending
only to itself.

Causal masking is bottom-right aligned: query i sees keys j <= i + S - T (for
T < S, a decode step or a chunk of prefill sees the whole cache). torch's
`is_causal=True` is top-left aligned, so it is used only when T == S; other
lengths get an explicit mask. Rows that see no key (T > S) give zeros.

The computation runs in the inputs' dtype; pass fp32 tensors for an fp32
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gate_activations import apply_gate


def causal_mask(T: int, S: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask `[T, S]`, True where query i may attend key j (j <= i + S - T)."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Ungated attention on one batch of equal lengths; `[B, T, HQ, D]` in and out."""
    T, S = q.shape[1], k.shape[1]
    first = max(T - S, 0) if causal else 0  # rows before `first` see no key
    out = q.new_zeros(q.shape)
    if first == T or S == 0:
        return out
    qs = q[:, first:].transpose(1, 2)  # [B, HQ, T', D]
    ks, vs = k.transpose(1, 2), v.transpose(1, 2)  # [B, HKV, S, D]
    mask = None
    if causal and T != S:
        mask = causal_mask(T, S, q.device)[first:]
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, is_causal=causal and T == S, scale=scale, enable_gqa=q.shape[2] != k.shape[2]
    )  # [B, HQ, T', D]
    if first == 0:
        return o.transpose(1, 2)
    return torch.cat([out[:, :first], o.transpose(1, 2)], dim=1)


def _sink_share(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """`sigmoid(lse - s_h)` per row, `[B, T, HQ, 1]`: what the keys keep of each row's softmax beside the sink."""
    T, S = q.shape[1], k.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * scale  # [B, HQ, T, S]
    if causal:
        logits = logits.masked_fill(~causal_mask(T, S, q.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, HQ, T]; -inf where a row sees no key (its output is 0 anyway)
    return torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None]).transpose(1, 2)[..., None]


def _attend(q, k, v, causal: bool, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    out = _sdpa(q, k, v, causal, scale)
    return out if sinks is None else out * _sink_share(q, k, causal, scale, sinks).to(out.dtype)


def gated_sdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate_activation: str = "sigmoid",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated SDPA in plain torch; arguments as `gated_attention.kernels.gated_sdpa`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        out = _attend(q, k, v, causal, scale, sinks)
    else:
        bounds = cu_seqlens.tolist()
        pieces = [_attend(q[:, a:b], k[:, a:b], v[:, a:b], causal, scale, sinks) for a, b in zip(bounds[:-1], bounds[1:])]
        out = torch.cat(pieces, dim=1) if pieces else q.new_zeros(q.shape)
    if gate is None:
        return out
    return apply_gate(out, gate if gate.dim() == 4 else gate.unsqueeze(-1), gate_activation)
