"""The Gated DeltaNet mixer (Yang et al., 2025), as fla's `GatedDeltaNet` layer computes it.

Parameter names are fla's (`q_proj`, `k_proj`, `v_proj`, `a_proj`, `b_proj`,
`g_proj`, `q_conv1d`, `k_conv1d`, `v_conv1d`, `A_log`, `dt_bias`, `o_norm`,
`o_proj`), so an fla / M-A-P GDN layer's weights load as they are; shapes,
nonlinearities and the gated output norm are those of fla and of transformers'
Qwen3.5 (which fuses q/k/v into `in_proj_qkv` and one `conv1d`).

    x [B, T, hidden] -> q, k [B, T, H, K], v [B, T, HV, V]   (projection, causal conv, SiLU)
    q, k l2-normalised; beta = sigmoid(b_proj x); g = -exp(A_log) * softplus(a_proj x + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)                     [B, T, HV, V]
    o = RMSNorm(o) * silu(g_proj x)   (or RMSNorm(o) without the output gate)
    out = o_proj(o)                                            [B, T, hidden]

With a cache (transformers' `DynamicCache(config=...)`, whose "linear_attention"
layers hold one conv state and one recurrent state), q/k/v conv inputs are
cached as one `[B, 2 * H * K + HV * V, conv_kernel]` state, and the delta-rule
state `[B, HV, K, V]` carries over to the next call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from ..compat import get_recurrent_state
from ..kernels.gated_delta_rule.chunk import gated_delta_rule


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, times `silu(gate)` when a gate is given.

    fla's `FusedRMSNormGated` (with the gate) / `RMSNorm` (without), and
    transformers' `Qwen3_5RMSNormGated`: normalised in fp32, weighted, gated.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight * x.to(input_dtype)
        if gate is not None:
            x = x * F.silu(gate.to(torch.float32))
        return x.to(input_dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim

        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        # Depthwise causal convolutions, fla's ShortConvolution: weight [D, 1, conv_kernel], no bias.
        self.q_conv1d = self._short_conv(self.key_dim)
        self.k_conv1d = self._short_conv(self.key_dim)
        self.v_conv1d = self._short_conv(self.value_dim)
        A_log, dt_bias = self.initial_decay_parameters()
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.output_gate = config.linear_output_gate
        if self.output_gate:
            self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _short_conv(self, channels: int) -> nn.Conv1d:
        k = self.conv_kernel_size
        return nn.Conv1d(channels, channels, kernel_size=k, groups=channels, padding=k - 1, bias=False)

    def initial_decay_parameters(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's init: A ~ U(0, 16), A_log = log A; dt ~ logU(1e-3, 0.1), dt_bias = softplus^-1(dt).

        Drawn in fp32 whatever the ambient dtype (`from_config(..., dtype=torch.bfloat16)` sets it), then
        returned in it: a bf16 U(0, 16) takes one of 512 values, 0 among them, and A = 0 makes A_log -inf,
        a head that never decays and never learns.
        """
        fp32 = dict(device=device, dtype=torch.float32)
        A_log = torch.empty(self.num_v_heads, **fp32).uniform_(0, 16).log()
        dt = torch.exp(torch.rand(self.num_v_heads, **fp32) * math.log(100) + math.log(1e-3)).clamp(min=1e-4)
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        dtype = torch.get_default_dtype()
        return A_log.to(dtype), dt_bias.to(dtype)

    def _conv(self, mixed: torch.Tensor, cache: Cache | None, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """SiLU(causal depthwise conv) over [q | k | v] channels: `[B, T, D]` -> `[B, T, D]`."""
        T = mixed.shape[1]
        x = mixed.transpose(1, 2)  # [B, D, T]
        if cache is not None:
            # Prefill: stores the last conv_kernel inputs and returns x; later calls return
            # [cached inputs | x], the left context the convolution needs.
            x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        if cu_seqlens is None:
            out = self._depthwise(x)
        else:  # packed sequences: no sequence sees the end of the previous one
            bounds = cu_seqlens.tolist()
            out = torch.cat([self._depthwise(x[..., s:e]) for s, e in zip(bounds[:-1], bounds[1:])], dim=-1)
        return F.silu(out[..., -T:]).transpose(1, 2)

    def _depthwise(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, D, t]` -> `[B, D, t]`, causal: each of q, k and v through its own convolution module.

        The modules are called, not their weights read: accelerate loads an offloaded module's weight
        only when the module itself runs (a weight read directly would still be on the meta device).
        Depthwise, every channel is its own convolution, so three calls give the numbers one would.
        """
        parts = x.split([self.key_dim, self.key_dim, self.value_dim], dim=1)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return torch.cat([conv(part)[..., : part.shape[-1]] for conv, part in zip(convs, parts)], dim=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[B, T, hidden]` -> `[B, T, hidden]`.

        `attention_mask` is the 2-D padding mask (or None): padded positions are
        zeroed, so they write nothing into the state (k = 0) and, being left
        padding, only decay a state that is still zero. `cu_seqlens` (int32
        `[N + 1]`) are the bounds of sequences packed into the rows, counted
        over the rows laid end to end: no sequence's state or convolution sees
        the one before it. Packed sequences are a training input and are never
        cached.
        """
        x = hidden_states
        if attention_mask is not None and attention_mask.dim() == 2:
            x = x * attention_mask[:, -x.shape[1] :, None].to(x.dtype)
        rows = x.shape[:2]
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("packed sequences (cu_seqlens) cannot be cached: each would need its own state")
            x = x.reshape(1, -1, x.shape[-1])  # [1, B * T, hidden]: the kernels take packed sequences in one row
        B, T, _ = x.shape
        # Read before the conv update below, which marks the layer as having a past.
        recurrent_state = get_recurrent_state(cache, self.layer_idx) if cache is not None else None

        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 2HK + HV*V]
        q, k, v = self._conv(mixed, cache, cu_seqlens).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        beta = self.b_proj(x).sigmoid()  # [B, T, HV]
        # In fp32: exp(A_log) can overflow in fp16, and g is a log decay summed over a chunk.
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())

        o, new_state = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=recurrent_state,
            output_final_state=cache is not None,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
        )  # [B, T, HV, V]
        if cache is not None:
            cache.update_recurrent_state(new_state, self.layer_idx)

        gate = self.g_proj(x).view(B, T, self.num_v_heads, self.head_v_dim) if self.output_gate else None
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(*rows, self.value_dim))
