"""Gated softmax attention, shared by the dense, MoE and hybrid families.

The layer is Llama's attention (Qwen3's with `qk_norm`) plus the gate of the
Gated Attention paper, a separate module `attn_gate` whose scores are computed
from the same normed hidden states X that feed q/k/v:

    Y' = Y * act(X W)   (multiplicative)      Y' = Y + act(X W)   (additive)

Y is the tensor at the spec's position (G1..G5, see `gate_spec.py`). q/k gates
(G4/G3) act after the projection (and q/k norm) and before RoPE; v/k gates act
before the cache, so cached keys and values are already gated. The projection
W is full (`AttentionGate`), low-rank (`LowRankAttentionGate`, spec key `rank`)
or absent (`ConstantAttentionGate`, learned constant logits), and reads the
first `input_channels` channels of X when the spec says so.

With `config.attention_sinks` each query head also has GPT-OSS's learned sink
logit, `self_attn.sinks` (see `attention_sinks.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.initialization import normal_, zeros_
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward

from ..configuration.gate_spec import GATE_NAME, gate_enabled, gate_input_width, gate_score_shape
from ..kernels.gated_sdpa.attention_interface import GATED_TRITON  # importing registers attn_implementation="gated_triton"
from ..kernels.gated_sdpa.gate_activations import FUSED_GATE_ACTIVATIONS, GATE_ACTIVATION_FUNCTIONS, apply_gate
from .attention_sinks import sink_attention


def fusable_gate(config) -> bool:
    """Whether attn_implementation="gated_triton" applies this config's gate inside the fused kernel.

    Only a G1 multiplicative sigmoid / ns_sigmoid gate can be fused, and only when
    nothing (an output norm or activation) sits between SDPA and the gate.
    """
    spec = config.attn_gate
    return (
        gate_enabled(spec)
        and spec["position"] == "sdpa"
        and spec["mode"] == "multiplicative"
        and spec["activation"] in FUSED_GATE_ACTIVATIONS
        and config.attn_output_norm is None
        and config.attn_output_activation is None
    )


class GateScores:
    """The arithmetic of a gate spec: activation, the scores' shape, and how they meet the gated tensor.

    Scores come flat, `[B, T, out_features]`, heads first then channels
    (`out_features` = H * D elementwise, H headwise, D or 1 when `head_shared`,
    hidden_size for G5 "dense"). `to_heads` views them to broadcast against the
    gated tensor: `[B, T, H, D]` (elementwise), `[B, T, H, 1]` (headwise), H = 1
    when `head_shared`, `[B, T, hidden_size]` for G5.

    They stay flat until here because tensor parallelism shards the gate's
    projection like `q_proj` (transformers' "colwise" and vLLM's column-parallel
    linear split a layer's output on its last dimension): each rank scores its
    own heads, and `to_heads` counts them with -1. This lives outside the
    `attn_gate` module because vLLM replaces an `nn.Linear` child with its own
    parallel linear, which computes the projection and nothing else.
    """

    def __init__(self, spec: dict, hidden_size: int, num_heads: int, num_key_value_heads: int, head_dim: int):
        self.position = spec["position"]
        self.mode = spec["mode"]
        self.activation = spec["activation"]
        self.act_fn = GATE_ACTIVATION_FUNCTIONS[spec["activation"]]
        self.head_shared = spec["head_shared"]
        self.score_shape = gate_score_shape(spec, hidden_size, num_heads, num_key_value_heads, head_dim)
        self.out_features = math.prod(self.score_shape)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.act_fn(logits)

    def to_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """`[B, T, out_features]` -> the shape that broadcasts against the gated tensor (see the class)."""
        if self.position == "dense":
            return scores
        heads = 1 if self.head_shared else -1  # -1: the heads this rank holds
        return scores.view(*scores.shape[:-1], heads, self.score_shape[-1])

    def combine(self, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Gate `y` (`[B, T, H, D]`, or `[B, T, hidden]` for G5) with flat logits."""
        logits = self.to_heads(logits)
        if self.position != "dense" and not self.head_shared and logits.shape[-2] != y.shape[-2]:
            # A broadcast would hide it when this rank holds one head: say it instead.
            raise ValueError(
                f"attn_gate scores {logits.shape[-2]} heads but the attention holds {y.shape[-2]}: the gate was not "
                f"sharded with the heads (vLLM shards only nn.Linear layers, so an input-independent gate runs "
                f"there only at tensor_parallel_size=1)"
            )
        return apply_gate(y, logits, self.activation, self.mode)

    def __repr__(self) -> str:
        return f"GateScores(position={self.position}, scores={self.score_shape}, {self.mode}, {self.activation})"


class AttentionGate(nn.Linear):
    """The gate's projection: flat logits `X W + b`, `[B, T, out_features]` (see `GateScores`).

    A plain `nn.Linear`, so that tensor parallelism in transformers and vLLM
    shards it as it shards q_proj. `gate_scores` is the arithmetic that turns
    its output into scores (hooks read it: analysis, the training meter).
    `in_features` is the gate's input width (the spec's `input_channels`).
    """

    def __init__(self, gate_scores: GateScores, in_features: int, bias: bool):
        super().__init__(in_features, gate_scores.out_features, bias=bias)
        self.gate_scores = gate_scores

    def init_weights(self, std: float) -> None:
        normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.gate_scores!r}"


class LowRankAttentionGate(nn.Module):
    """A low-rank gate projection: flat logits `up(down(X))`, `[B, T, out_features]`, through `rank` values.

    Two plain `nn.Linear`s (`down` `[rank, in_features]`, `up` `[out_features, rank]` with the spec's bias), so
    tensor parallelism shards `up` as it would the full gate and keeps `down` whole. Like `AttentionGate`, its
    output is the logits and `gate_scores` turns them into scores.
    """

    def __init__(self, gate_scores: GateScores, in_features: int, rank: int, bias: bool):
        super().__init__()
        self.gate_scores = gate_scores
        self.in_features, self.out_features = in_features, gate_scores.out_features
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, gate_scores.out_features, bias=bias)

    def init_weights(self, std: float) -> None:
        normal_(self.down.weight, mean=0.0, std=std)
        normal_(self.up.weight, mean=0.0, std=std)
        if self.up.bias is not None:
            zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return repr(self.gate_scores)


class ConstantAttentionGate(nn.Module):
    """An input-independent gate: learnable logits `c`, the same for every token, `[B, T, out_features]`."""

    def __init__(self, gate_scores: GateScores, hidden_size: int):
        super().__init__()
        self.gate_scores = gate_scores
        # transformers' colwise style shards a module with these (the logits split like a weight's rows).
        self.in_features, self.out_features = hidden_size, gate_scores.out_features
        # Zero logits: every score starts at act(0), as in the paper's ablation.
        self.logits = nn.Parameter(torch.zeros(gate_scores.out_features))

    def init_weights(self, std: float) -> None:
        zeros_(self.logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.to(x.dtype).expand(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return repr(self.gate_scores)


# The gate's projection classes, each with its own random init (`init_weights(std)`).
GATE_CLASSES = (AttentionGate, LowRankAttentionGate, ConstantAttentionGate)


def build_gate(spec: dict, gate_scores: GateScores, in_features: int) -> nn.Module:
    """The gate projection a normalised spec asks for, reading an input of `in_features` channels: learned
    constant logits (`input_dependent` false), a low-rank projection (`rank`), or a full one."""
    if not spec["input_dependent"]:
        return ConstantAttentionGate(gate_scores, in_features)
    width = gate_input_width(spec, in_features)
    if spec["rank"] is not None:
        return LowRankAttentionGate(gate_scores, width, spec["rank"], bias=spec["bias"])
    return AttentionGate(gate_scores, width, bias=spec["bias"])


def gate_logits(gate: nn.Module, x: torch.Tensor, input_channels: int | None) -> torch.Tensor:
    """Flat gate logits `[B, T, out_features]` from the gate's input `[B, T, in_features]`, of which it reads the
    first `input_channels` channels (None: all)."""
    return gate(x if input_channels is None else x[..., :input_channels])


class GatedAttention(nn.Module):
    """Multi-head (GQA) attention with an optional output or projection gate.

    Parameter names are Llama's (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and
    Qwen3's (`q_norm`, `k_norm`), so their checkpoints load unchanged.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        layer_type = config.layer_types[layer_idx] if config.layer_types else "full_attention"
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None

        hidden, bias = config.hidden_size, config.attention_bias
        qkv_bias = bias or config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

        spec = config.attn_gate
        self.gate_position = spec["position"] if gate_enabled(spec) else None
        self.gate_input_channels = spec["input_channels"]  # None: all of X
        if self.gate_position is not None:
            self.gate_scores = GateScores(spec, hidden, self.num_heads, self.num_key_value_heads, self.head_dim)
            self.add_module(GATE_NAME, build_gate(spec, self.gate_scores, hidden))
        # One logit per query head, as GPT-OSS; `None` without sinks. The attention call hands it over as
        # `s_aux=self.sinks` in so many words: vLLM's transformers backend reads that keyword from the source of
        # `forward` to give its own attention the parameter it names.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        if config.attn_output_norm == "rmsnorm":
            self.attn_output_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn_output_act = F.silu if config.attn_output_activation == "silu" else None
        self.fusable_gate = fusable_gate(config)

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Flat gate logits `[B, T, out_features]` from the layer input `[B, T, hidden]`."""
        return gate_logits(self.attn_gate, x, self.gate_input_channels)

    def _gate(self, position: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.gate_position != position:
            return y
        return self.gate_scores.combine(y, self._gate_logits(x))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = hidden_states
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        q = self.q_proj(x).view(hidden_shape)  # [B, T, HQ, D]
        k = self.k_proj(x).view(hidden_shape)  # [B, T, HKV, D]
        v = self.v_proj(x).view(hidden_shape)  # [B, T, HKV, D]
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._gate("query", x, q)
        k = self._gate("key", x, k)
        v = self._gate("value", x, v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]

        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)

        implementation = self.config._attn_implementation
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if self.sinks is not None:
            attention_interface = sink_attention(implementation, attention_interface)
        fused_gate = self.fusable_gate and implementation == GATED_TRITON
        if fused_gate:  # hand the gate logits to the kernel, which applies act() in its epilogue
            logits = self.gate_scores.to_heads(self._gate_logits(x))  # [B, T, HQ or 1, D or 1]
            logits = logits.expand(*input_shape, q.shape[1], logits.shape[-1])  # q: [B, HQ, T, D], this rank's HQ
            gate = logits[..., 0] if logits.shape[-1] == 1 else logits  # [B, T, HQ] or [B, T, HQ, D]
            kwargs = {**kwargs, "gate": gate, "gate_activation": self.gate_scores.activation}
        attn_output, attn_weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            s_aux=self.sinks,  # [HQ] or None
            **kwargs,
        )
        # [B, T, HQ, D] from transformers' functions; a serving engine's own (vLLM's transformers backend)
        # returns its paged layout [tokens, HQ * D] for a batch of one. The gate and norm need heads.
        # Under tensor parallelism a rank holds HQ / tp heads: count them with -1, never from the config.
        attn_output = attn_output.reshape(*input_shape, -1, self.head_dim)  # [B, T, HQ, D]

        if self.config.attn_output_norm == "rmsnorm":
            attn_output = self.attn_output_norm(attn_output)
        if self.attn_output_act is not None:
            attn_output = self.attn_output_act(attn_output)
        if not fused_gate:
            attn_output = self._gate("sdpa", x, attn_output)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # [B, T, HQ * D]
        attn_output = self.o_proj(attn_output)
        attn_output = self._gate("dense", x, attn_output)
        return attn_output, attn_weights
