"""fla's fused norms in torch: RMSNorm / LayerNorm with a residual add, the gated variants, norm + linear.

Meaning and arguments are fla's (`fla.modules.norm`: `layer_norm`, `rms_norm`,
`layer_norm_linear`, `rms_norm_linear`, `layer_norm_gated`, `rms_norm_gated`,
`layer_norm_swish_gate_linear`, `rms_norm_swish_gate_linear`), and so are the
numerics of its kernels: in fp32,

    z = x + residual                       (when a residual is given)
    y = (z - mean(z)) / sqrt(var(z) + eps)  (LayerNorm; RMSNorm: z / sqrt(mean(z^2) + eps))
    y = y * weight + bias
    y = y * act(g)                         (gated: act = swish or sigmoid)

y is returned in x's dtype. With `prenorm` the sum z comes back too, as the
next block's residual: in the residual's dtype, or fp32 with
`residual_in_fp32`, else x's dtype. `num_groups` normalises each of G equal
slices of the last dimension on its own (GroupNorm). fla's own torch twins are
`rms_norm_ref` / `layer_norm_ref` in `fla/modules/norm/layernorm.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


def torch_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
    num_groups: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's `layer_norm` (`rms_norm` with `is_rms_norm=True`): normalise the last dimension of x."""
    y, z = _normalize(x, weight, bias, residual, eps, is_rms_norm, num_groups)
    y = y.to(x.dtype)
    return (y, _residual_out(x, residual, z, residual_in_fp32)) if prenorm else y


def torch_rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """fla's `rms_norm`."""
    return torch_layer_norm(x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm=True)


def torch_layer_norm_linear(
    x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5, prenorm=False,
    residual_in_fp32=False, is_rms_norm=False, num_groups=1,
):
    """fla's `layer_norm_linear`: the norm, then a linear layer in x's dtype."""
    y = torch_layer_norm(x, norm_weight, norm_bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm, num_groups)
    y, z = y if prenorm else (y, None)
    out = F.linear(y, linear_weight.to(y.dtype), None if linear_bias is None else linear_bias.to(y.dtype))
    return (out, z) if prenorm else out


def torch_rms_norm_linear(
    x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5, prenorm=False,
    residual_in_fp32=False,
):
    """fla's `rms_norm_linear`."""
    return torch_layer_norm_linear(
        x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm, residual_in_fp32, True
    )


def torch_layer_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
    is_rms_norm: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's `layer_norm_gated` (`rms_norm_gated` with `is_rms_norm=True`): the norm times act(g)."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not allowed; allowed values: {GATE_ACTIVATIONS}")
    y, z = _normalize(x, weight, bias, residual, eps, is_rms_norm, 1)
    gate = g.to(torch.float32)
    y = (y * gate.sigmoid() if activation == "sigmoid" else y * gate * gate.sigmoid()).to(x.dtype)
    return (y, _residual_out(x, residual, z, residual_in_fp32)) if prenorm else y


def torch_rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                         residual_in_fp32=False, eps=1e-6):
    """fla's `rms_norm_gated`."""
    return torch_layer_norm_gated(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps, True)


def torch_layer_norm_swish_gate_linear(
    x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, prenorm=False,
    residual_in_fp32=False, eps=1e-6, is_rms_norm=False,
):
    """fla's `layer_norm_swish_gate_linear`: the swish-gated norm, then a linear layer in x's dtype."""
    y = torch_layer_norm_gated(x, g, norm_weight, norm_bias, "swish", residual, prenorm, residual_in_fp32, eps,
                               is_rms_norm)
    y, z = y if prenorm else (y, None)
    out = F.linear(y, linear_weight.to(y.dtype), None if linear_bias is None else linear_bias.to(y.dtype))
    return (out, z) if prenorm else out


def torch_rms_norm_swish_gate_linear(
    x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, prenorm=False,
    residual_in_fp32=False, eps=1e-6,
):
    """fla's `rms_norm_swish_gate_linear`."""
    return torch_layer_norm_swish_gate_linear(
        x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual, prenorm, residual_in_fp32, eps, True
    )


def _normalize(x, weight, bias, residual, eps, is_rms_norm, num_groups):
    """(y = normalised, weighted z in fp32, z = x + residual in fp32)."""
    z = x.to(torch.float32)
    if residual is not None:
        z = z + residual.to(torch.float32)
    shape = z.shape
    grouped = z.unflatten(-1, (num_groups, shape[-1] // num_groups))  # [..., G, D / G]
    if is_rms_norm:
        y = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    else:
        centred = grouped - grouped.mean(-1, keepdim=True)
        y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    y = y.view(shape)
    if weight is not None:
        y = y * weight.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y, z


def _residual_out(x, residual, z, residual_in_fp32):
    if residual is not None:
        return z.to(residual.dtype)
    return z if residual_in_fp32 else z.to(x.dtype)
