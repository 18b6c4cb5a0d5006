"""Configuration of the hybrid Gated DeltaNet + softmax attention causal LM (the models of
"Massive Activations in Hybrid Linear Attention Large Language Models: Pre-Attention Spikes and Inter-Spike Plateaus").

Layers are `"linear_attention"` (a Gated DeltaNet mixer) or `"full_attention"`
(the shared gated softmax attention, gated or not by `attn_gate`); `sliding_attention`
works as in the dense model. Every layer has an MLP: dense, or sparse MoE when
`num_experts > 0` (the MoE config's fields and rule, inherited). The GDN
fields use transformers' Qwen3-Next / Qwen3.5 names (`linear_*`).

The schedule is `layer_types`, or `hybrid_ratio`, the paper's rho : 1 with
rho = L / L_FA: one full-attention layer in every rho layers, placed last in
each block of rho, i.e. layer i (0-based) is full attention when
(i + 1) % rho == 0. So for 24 layers, "3:1" has 8 full-attention layers
(GDN, GDN, FA, ...), "24:1" has one, the last. (Qwen3.5's "three GDN then one
attention" pattern is rho = 4 in this definition, as the paper notes.)
"""

from __future__ import annotations

import re

from .gated_attention import ATTENTION_LAYER_TYPES
from .gated_attention_moe import GatedAttentionMoeConfig
from .presets import from_preset

HYBRID_LAYER_TYPES = ("linear_attention", *ATTENTION_LAYER_TYPES)


def normalize_hybrid_ratio(ratio: int | str | None) -> int | None:
    """`3`, `"3"`, `"3:1"` -> 3 (rho of the massive-activations paper's rho:1); None stays None."""
    if ratio is None or (isinstance(ratio, int) and not isinstance(ratio, bool) and ratio >= 1):
        return ratio
    if isinstance(ratio, str) and (match := re.fullmatch(r"\s*(\d+)\s*(?::\s*1\s*)?", ratio)) and int(match[1]) >= 1:
        return int(match[1])
    raise ValueError(f"hybrid_ratio={ratio!r} is not allowed; allowed values: a positive int rho or 'rho:1' (e.g. '3:1')")


def hybrid_layer_types(num_layers: int, ratio: int) -> list[str]:
    """The massive-activations paper's rho:1 schedule: full attention closes every block of `ratio` layers."""
    return ["full_attention" if (i + 1) % ratio == 0 else "linear_attention" for i in range(num_layers)]


class GatedDeltaNetHybridConfig(GatedAttentionMoeConfig):
    r"""Hybrid of Gated DeltaNet layers and gated softmax attention layers.

    Gated DeltaNet layers (fla's `GatedDeltaNet`): q/k projections to
    `linear_num_key_heads` heads of `linear_key_head_dim`, v to
    `linear_num_value_heads` (default: as many as key heads) heads of
    `linear_value_head_dim`, depthwise causal convolutions of width
    `linear_conv_kernel_dim` with SiLU on q, k and v, l2-normalised q/k, decay
    `g = -exp(A_log) * softplus(a + dt_bias)`, write strength `beta = sigmoid(b)`,
    per-head RMSNorm on the output, times `silu(g_proj(x))` when
    `linear_output_gate` (False is the massive-activations paper's "GDN-NoOutGate" variant).

    Full-attention layers read every attention field of `GatedAttentionConfig`,
    `attn_gate` included (the massive-activations paper's "GDN-GatedFA" is `attn_gate={}` on a
    preset whose attention is ungated).

    ```python
    >>> from gated_attention import GatedDeltaNetHybridConfig
    >>> GatedDeltaNetHybridConfig(num_hidden_layers=6, hybrid_ratio="3:1").layer_types
    ['linear_attention', 'linear_attention', 'full_attention', 'linear_attention', 'linear_attention', 'full_attention']
    >>> GatedDeltaNetHybridConfig.from_preset("gdn-340m-12to1").layer_types.count("full_attention")
    2
    ```
    """

    model_type = "gated_deltanet_hybrid"
    allowed_layer_types = HYBRID_LAYER_TYPES
    # Tensor parallelism (`tensor_parallel.py`): attention and MLPs as in the dense and MoE configs; each Gated
    # DeltaNet projection holds a shard of its weights and gathers its output, as in Qwen3-Next, so every rank runs
    # the whole recurrence with its convolutions and decay parameters whole.

    hybrid_ratio: int | str | None = None
    linear_num_key_heads: int = 6
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int = 256
    linear_value_head_dim: int = 512
    linear_conv_kernel_dim: int = 4
    linear_output_gate: bool = True
    # Dense MLPs unless asked: the MoE fields are inherited with experts off.
    num_experts: int = 0

    # Named shapes of the massive-activations paper (see `presets.py`), e.g. `from_preset("gdn-1.3b-3to1")`.
    from_preset = classmethod(from_preset)

    def __post_init__(self, **kwargs):
        self.hybrid_ratio = normalize_hybrid_ratio(self.hybrid_ratio)
        if self.layer_types is None:
            ratio = self.hybrid_ratio if self.hybrid_ratio is not None else 3
            self.layer_types = hybrid_layer_types(self.num_hidden_layers, ratio)
        elif self.hybrid_ratio is not None:
            expected = hybrid_layer_types(len(self.layer_types), self.hybrid_ratio)
            if list(self.layer_types) != expected:
                raise ValueError(
                    f"layer_types {self.layer_types} do not follow hybrid_ratio={self.hybrid_ratio} "
                    f"({expected}); give one of the two"
                )
        if self.linear_num_value_heads is None:
            self.linear_num_value_heads = self.linear_num_key_heads
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
        super().__post_init__(**kwargs)
