"""`gated_sdpa`: gated softmax attention, `softmax(q k^T * scale) v * act(gate)`, optionally with learned sinks.

The Triton kernels (`triton.py`) run on CUDA tensors, and on CPU
tensors when TRITON_INTERPRET=1 (triton's interpreter, slow, for tests); the
plain-torch reference (`reference.py`: SDPA, then the gate) runs
everywhere else and for inputs the kernels do not cover. The path is chosen
per call from the tensors and logged once.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .gate_activations import FUSED_GATE_ACTIVATIONS
from .reference import gated_sdpa_reference

logger = logging.get_logger(__name__)

BACKENDS = ("auto", "triton", "torch")


def _triton_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate_activation: str):
    """(the Triton entry point, None) when the kernels can run these inputs, else (None, why not)."""
    try:
        # Imported on first use, not with this module: triton reads TRITON_INTERPRET when the
        # kernels are defined, and triton may be missing altogether.
        from .triton import gated_sdpa_triton, unsupported_reason
    except ImportError as error:
        return None, str(error)
    reason = unsupported_reason(q, k, v, gate_activation)
    return (gated_sdpa_triton, None) if reason is None else (None, reason)


def _log_once(log, message: str) -> None:
    # torch.compile cannot trace a Logger call (with fullgraph=True it raises there); the eager calls log.
    if not torch.compiler.is_compiling():
        log(message)


def _check_inputs(q, k, v, gate, cu_seqlens, gate_activation, backend, sinks=None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed values: {', '.join(map(repr, BACKENDS))}")
    if gate_activation not in FUSED_GATE_ACTIVATIONS:
        allowed = ", ".join(map(repr, FUSED_GATE_ACTIVATIONS))
        raise ValueError(f"gate_activation={gate_activation!r} is not allowed; allowed values: {allowed}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        shapes = ", ".join(str(tuple(x.shape)) for x in (q, k, v))
        raise ValueError(f"expected q [B, T, HQ, D] and k, v [B, S, HKV, D]; got {shapes}")
    B, T, HQ, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or HQ % k.shape[2] != 0:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: need the same B and D and HQ % HKV == 0")
    if gate is not None and tuple(gate.shape) not in ((B, T, HQ, D), (B, T, HQ)):
        raise ValueError(f"gate must be [B, T, HQ, D] = {(B, T, HQ, D)} or [B, T, HQ]; got {tuple(gate.shape)}")
    if sinks is not None and tuple(sinks.shape) != (HQ,):
        raise ValueError(f"sinks must be [HQ] = {(HQ,)}; got {tuple(sinks.shape)}")
    if cu_seqlens is not None and (B != 1 or k.shape[1] != T or cu_seqlens.dim() != 1):
        raise ValueError("with cu_seqlens, q/k/v hold packed sequences: B must be 1, S == T, cu_seqlens 1-D [N+1]")


def gated_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate_activation: str = "sigmoid",
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated scaled-dot-product attention; differentiable in q, k, v and gate.

    Args:
        q: `[B, T, HQ, D]`.
        k, v: `[B, S, HKV, D]`, HQ a multiple of HKV (GQA/MQA).
        gate: pre-activation gate logits, `[B, T, HQ, D]` (elementwise) or
            `[B, T, HQ]` (headwise); None for plain attention.
        causal: bottom-right aligned, query i sees keys j <= i + S - T; rows
            that see no key give zeros.
        scale: softmax scale, default `D ** -0.5`.
        cu_seqlens: int32 `[N+1]` offsets of N packed sequences (B == 1, S == T).
        gate_activation: "sigmoid" or "ns_sigmoid" (0.5 + 0.5 * sigmoid).
        backend: "auto" (Triton when the kernels can run the inputs, else torch),
            "triton" (raise if they cannot), "torch" (the reference).
        sinks: `[HQ]` learned sink logits (GPT-OSS's): one more term in each
            row's softmax denominator, with no value; differentiable.

    Returns:
        `[B, T, HQ, D]` in q's dtype.
    """
    _check_inputs(q, k, v, gate, cu_seqlens, gate_activation, backend, sinks)
    kwargs = dict(causal=causal, scale=scale, cu_seqlens=cu_seqlens, gate_activation=gate_activation, sinks=sinks)
    if backend != "torch":
        kernel, reason = _triton_kernel(q, k, v, gate_activation)
        if kernel is not None:
            _log_once(logger.info_once, "gated_sdpa: running the Triton kernels")
            return kernel(q, k, v, gate, **kwargs)
        if backend == "triton":
            raise RuntimeError(f"gated_sdpa(backend='triton') cannot run these inputs: {reason}")
        _log_once(logger.warning_once, f"gated_sdpa: {reason}; running the torch reference (SDPA + gate) instead")
    return gated_sdpa_reference(q, k, v, gate, **kwargs)
