"""GPT-OSS's learned attention sink: one logit per query head, in the softmax's denominator and nowhere else.

    p_tj = exp(l_tj) / (exp(s_h) + sum_j' exp(l_tj'))      o_t = sum_j p_tj v_j

The sink has no value, so it takes probability mass from every key: a head
can attend to nothing, the job the first token does as a sink in ungated
attention and the gate does in the Gated Attention paper. It is
`softmax(l_t) V * sigmoid(lse_t - s_h)`: a headwise, query-dependent gate on
the SDPA output that the attention computes itself.

`sink_attention` picks the function that runs it for an `attn_implementation`:

- "eager": transformers' GPT-OSS eager function (the sink as one more softmax
  column), the same weights' reference (tests/test_dense.py);
- "sdpa": `sdpa_with_sinks`, transformers' SDPA over one more key, all zeros
  with a zero value, whose logit `s_h` comes in as an additive mask column. The
  mask is then a float `[B, HQ, T, S + 1]` tensor (transformers' GPT-OSS
  offers no SDPA path at all);
- flash attention and flex attention: transformers' own functions, handed the
  sinks as `s_aux`, as GPT-OSS does (flash kernels without sinks refuse it
  there; flex attention refuses it on a CPU);
- anything else (a serving engine's attention, "gated_triton", paged
  attention) would drop the sink without a word: refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention_forward


def local_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """This rank's sinks: under tensor parallelism the parameter is sharded with the heads (a DTensor)."""
    return sinks.to_local() if hasattr(sinks, "to_local") else sinks


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


def _eager_with_sinks(module, query, key, value, attention_mask, scaling, dropout=0.0, s_aux=None, **kwargs):
    # GPT-OSS's eager function reads `module.sinks`; the sinks this rank holds are handed over as `s_aux`.
    return gpt_oss_eager_attention_forward(
        _SinksView(module, s_aux), query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


class _SinksView:
    """The attention module as GPT-OSS's eager function reads it, with `sinks` this rank's slice."""

    def __init__(self, module: torch.nn.Module, sinks: torch.Tensor):
        self._module, self.sinks = module, sinks

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def sink_attention(implementation: str, interface: Callable) -> Callable:
    """The attention function that applies the sinks (passed as `s_aux`) for `implementation`; raises for one that
    would ignore them."""
    if implementation == "eager":
        return _eager_with_sinks
    if implementation == "sdpa":
        return sdpa_with_sinks
    if implementation == "flex_attention" or "flash" in implementation:
        return interface  # transformers' own, which take `s_aux`
    raise ValueError(
        f"attention_sinks=true cannot run with attn_implementation={implementation!r}, which would ignore the sinks; "
        f"use 'eager', 'sdpa', 'flex_attention' or a flash attention with sinks"
    )
