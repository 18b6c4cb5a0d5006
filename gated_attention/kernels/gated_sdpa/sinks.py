"""`sdpa_with_sinks`: transformers' SDPA with GPT-OSS's learned sinks, one logit per query head in the softmax's
denominator and nowhere else.

The sink is one more key, all zeros with a zero value, whose logit `s_h`
comes in as an additive mask column: the mask is a float `[B, HQ, T, S + 1]`
tensor (transformers' GPT-OSS has no SDPA path at all). torch's SDPA
differentiates the mask, so the sinks get their gradient. `"sdpa"` with sinks
runs it, and so does `"gated_triton"` on a batch its kernel cannot take.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def sdpa_with_sinks(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[B, HQ, T, D]`, key/value `[B, HKV, S, D]` (transformers' layout), `s_aux` `[HQ]` -> (`[B, T, HQ, D]`, None).

    `attention_mask` is what transformers' SDPA mask builder made: boolean (True = may attend) or additive,
    `[B or 1, 1, T, >= S]`, or None for plain causal attention whose T queries are the last T of the S keys.
    """
    B, HQ, T, _ = query.shape
    S = key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(T, S, dtype=torch.bool, device=query.device)
        if getattr(module, "is_causal", True):
            allowed = allowed.tril(diagonal=S - T)  # bottom-right: query i sees keys j <= i + S - T
        attention_mask = allowed[None, None]
    attention_mask = attention_mask[..., :S]
    if attention_mask.dtype == torch.bool:
        bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        bias = bias.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    else:
        bias = attention_mask.to(query.dtype)
    sink_column = s_aux.to(query.dtype).view(1, HQ, 1, 1).expand(B, HQ, T, 1)
    bias = torch.cat([bias.expand(B, HQ, T, S), sink_column], dim=-1)  # [B, HQ, T, S + 1]
    zero = key.new_zeros(*key.shape[:2], 1, key.shape[-1])
    return sdpa_attention_forward(
        module,
        query,
        torch.cat([key, zero], dim=2),  # [B, HKV, S + 1, D]: the sink's key; its logit is the bias column
        torch.cat([value, zero], dim=2),  # the sink's value: nothing
        bias,
        dropout=dropout,
        scaling=scaling,
        **kwargs,
    )
