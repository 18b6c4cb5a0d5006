"""fla's short convolution (`ShortConvolution`, `causal_conv1d`) in torch: a causal depthwise conv1d.

Layout and meaning are fla's (`fla.modules.causal_conv1d`). Channel d of x
`[B, T, D]` is convolved with its own W taps, weight `[D, W]`, over the
current and the W - 1 previous positions:

    y_t = act(bias + sum_w weight[:, w] * x_{t - W + 1 + w}) (+ residual_t)

act is SiLU ("silu" / "swish") or none. The state `[N, D, W]` holds the last
W inputs of each sequence (the oldest first): an initial state supplies the
left context of the first positions, and the final state is what a decode
step continues from. Computed in fp32, returned in x's dtype, as fla's
kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution of x `[B, T, D]` with weight `[D, W]`.

    `initial_state` `[N, D, W]` (N = B, or the number of packed sequences given by
    `cu_seqlens`, B = 1); returns `(y [B, T, D], final_state [N, D, W] or None)`.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not allowed; allowed values: {ACTIVATIONS}")
    if cu_seqlens is None:
        return _conv(x, weight, bias, residual, initial_state, output_final_state, activation)
    bounds = cu_seqlens.tolist()
    ys, states = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        y, state = _conv(
            x[:, start:end], weight, bias, None if residual is None else residual[:, start:end],
            None if initial_state is None else initial_state[i : i + 1], output_final_state, activation,
        )
        ys.append(y)
        states.append(state)
    return torch.cat(ys, dim=1), torch.cat(states) if output_final_state else None


def _conv(x, weight, bias, residual, initial_state, output_final_state, activation):
    B, T, D = x.shape
    W = weight.shape[-1]
    left = x.new_zeros(B, D, W - 1) if initial_state is None else initial_state[..., 1:].to(x.dtype)
    inputs = torch.cat([left, x.transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    y = F.conv1d(
        inputs.to(torch.float32), weight.to(torch.float32).unsqueeze(1),
        None if bias is None else bias.to(torch.float32), groups=D,
    )  # [B, D, T]
    if activation is not None:
        y = F.silu(y)
    y = y.transpose(1, 2)
    if residual is not None:
        y = y + residual.to(torch.float32)
    final_state = inputs[..., -W:].contiguous() if output_final_state else None
    return y.to(x.dtype), final_state


def torch_causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: x `[N, D]`, `[N, 1, D]` or `[1, N, D]` (one position per sequence) shifted into
    `cache` `[N, D, W]` in place (as fla's kernel does); returns `(y, cache)`, y shaped as x."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not allowed; allowed values: {ACTIVATIONS}")
    shape = x.shape
    N, D, W = cache.shape
    step = x.reshape(N, D)
    cache.copy_(torch.cat([cache[..., 1:], step.unsqueeze(-1).to(cache.dtype)], dim=-1))
    window = cache.to(torch.float32)
    y = (window * weight.to(torch.float32)).sum(-1) if weight is not None else window.sum(-1)
    if bias is not None:
        y = y + bias.to(torch.float32)
    if activation is not None:
        y = F.silu(y)
    if residual is not None:
        y = y + residual.reshape(N, D).to(torch.float32)
    return y.to(x.dtype).view(shape), cache
