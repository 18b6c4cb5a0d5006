"""`attn_implementation="gated_triton"`: the fused gated-SDPA kernel as a transformers attention implementation.

Importing this module registers the name with transformers' `AttentionInterface`
(the attention function) and `AttentionMaskInterface` (the mask builder; without
it `create_causal_mask` hands a custom implementation no mask at all).

The attention function takes the G1 gate logits as `gate` (`[B, T, HQ, D]` or
`[B, T, HQ]`) and applies `act(gate)` in the kernel's epilogue; the attention
module then skips its own gate multiply (see `GatedAttention` in
modeling/attention.py). Learned sinks come as `s_aux` (`[HQ]`, as transformers
passes GPT-OSS's) and go into the kernel's softmax. Which path runs:

- plain causal attention with no padding, whose T queries are the last T of the
  S keys (training, prefill, decode with `DynamicCache`): the mask builder
  returns None and `gated_sdpa` runs the kernel (decode takes its split-KV path);
- packed sequences with flash-attn's kwargs `cu_seq_lens_q` / `cu_seq_lens_k`
  (as transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
  gives them, B == 1): the kernel with `cu_seqlens`, whatever mask was built, as
  transformers' flash-attention path does;
- anything else needing a mask (padding, packing given by position_ids alone, a
  sliding window, a static cache) or dropout: transformers' SDPA with sdpa's
  explicit boolean mask (`sinks.sdpa_with_sinks` with sinks), then the gate,
  i.e. exactly the "sdpa" computation. This fallback is logged once.

`gated_sdpa` itself runs its torch reference where the kernels cannot run
(CPU tensors without TRITON_INTERPRET=1, unsupported head dims), so
"gated_triton" is valid everywhere.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .dispatch import gated_sdpa
from .gate_activations import apply_gate
from .sinks import sdpa_with_sinks

logger = logging.get_logger(__name__)

GATED_TRITON = "gated_triton"


def gated_triton_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """None when the kernel's own bottom-right causal masking is exact, else sdpa's explicit boolean mask."""
    no_padding = attention_mask is None or (
        attention_mask.shape[-1] >= kv_offset + kv_length
        and bool(attention_mask[:, kv_offset : kv_offset + kv_length].all())
    )
    queries_last = int(q_offset) + q_length == kv_offset + kv_length
    if mask_function is causal_mask_function and no_padding and queries_last:
        return None
    kwargs["allow_is_causal_skip"] = False  # None must always mean "plain causal" to the attention function
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def gated_triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    gate: torch.Tensor | None = None,
    gate_activation: str = "sigmoid",
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[B, HQ, T, D]`, key/value `[B, HKV, S, D]` (transformers' layout) -> (`[B, T, HQ, D]`, None)."""
    T, S = query.shape[2], key.shape[2]
    windowed = sliding_window is not None and S > sliding_window
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    packed = (
        cu_seqlens is not None
        and query.shape[0] == 1
        and T == S
        and (kwargs.get("cu_seq_lens_k") is None or torch.equal(kwargs["cu_seq_lens_k"], cu_seqlens))
    )
    if (attention_mask is None or packed) and dropout == 0.0 and not windowed:
        out = gated_sdpa(
            query.transpose(1, 2),  # [B, T, HQ, D] views: the kernels read strided inputs
            key.transpose(1, 2),
            value.transpose(1, 2),
            gate,
            causal=getattr(module, "is_causal", True),
            scale=scaling,
            cu_seqlens=cu_seqlens.to(torch.int32) if packed else None,
            gate_activation=gate_activation,
            sinks=s_aux,
        )
        return out, None

    logger.warning_once(
        "gated_triton: this batch needs an attention mask (padding, packing, sliding window or static cache) "
        "or dropout; running transformers' SDPA and the gate instead of the fused kernel"
    )
    sdpa = sdpa_attention_forward if s_aux is None else partial(sdpa_with_sinks, s_aux=s_aux)
    out, _ = sdpa(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
        **kwargs,
    )  # [B, T, HQ, D]
    if gate is not None:
        out = apply_gate(out, gate if gate.dim() == 4 else gate.unsqueeze(-1), gate_activation)
    return out, None


ALL_ATTENTION_FUNCTIONS.register(GATED_TRITON, gated_triton_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(GATED_TRITON, gated_triton_mask)
