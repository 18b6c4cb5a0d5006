"""The gate's activation functions, by the name `config.attn_gate["activation"]` uses.

    sigmoid(x)                                in [0, 1]     multiplicative gates
    ns_sigmoid(x) = 0.5 + 0.5 * sigmoid(x)    in [0.5, 1]   multiplicative, the paper's non-sparse variant
    silu(x) = x * sigmoid(x)                  unbounded     additive gates only

The names are `configuration.gate_spec.GATE_ACTIVATION_NAMES`; tests/test_gate_spec.py
checks that the two agree. The fused kernels take only the bounded, multiplicative
ones (`FUSED_GATE_ACTIVATIONS`).

`apply_gate` is the one place a gate meets the tensor it gates, for the model's
gate and for the torch paths of `gated_sdpa`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def ns_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The paper's non-sparse sigmoid, in [0.5, 1]."""
    return 0.5 + 0.5 * torch.sigmoid(x)


GATE_ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": ns_sigmoid,
}
# The activations `gated_sdpa` and attn_implementation="gated_triton" apply in the kernel's epilogue.
FUSED_GATE_ACTIVATIONS = ("sigmoid", "ns_sigmoid")


def apply_gate(y: torch.Tensor, logits: torch.Tensor, activation: str, mode: str = "multiplicative") -> torch.Tensor:
    """`y * act(logits)` (multiplicative) or `y + act(logits)` (additive), returned in y's dtype.

    `logits` broadcast against `y`: `[B, T, H, D]` or `[B, T, H, 1]` against `[B, T, H, D]`, `[B, T, hidden]`
    against the same for G5. The activation and the product run in fp32 and are rounded once, as Megatron-LM's
    output gate and the fused kernel's epilogue do: in bf16 that halves the error of the logits' gradient
    against rounding the scores first, as transformers' Qwen3.5 does (`benchmarks/gate_precision.py`, figures
    in benchmarks/RESULTS.md). The backward keeps the fp32 scores. fp64 stays fp64.
    """
    scores = GATE_ACTIVATION_FUNCTIONS[activation](logits.to(torch.promote_types(logits.dtype, torch.float32)))
    return (y * scores if mode == "multiplicative" else y + scores).to(y.dtype)
