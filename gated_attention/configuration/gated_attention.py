"""Configuration of the dense gated-attention causal LM.

Field names are transformers' Llama/Qwen names, so a Llama, Mistral, Qwen2 or
Qwen3 `config.json` maps onto this config key for key (see `convert/`). On top
of them: `qkv_bias` (Qwen2: bias on q/k/v but not on o_proj, whereas
`attention_bias` is Llama's bias on all four), `qk_norm` (Qwen3),
`sliding_window` (Mistral/Qwen2; None = off) with Qwen2/Qwen3's flag
`use_sliding_window` beside it, the gate spec `attn_gate` (see `gate_spec.py`),
the paper's two non-gate ablations on the SDPA output, and `attention_sinks`
(GPT-OSS's learned per-head sink logit, the baseline the gate is compared with).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

# First: it checks the installed transformers, which the imports below depend on.
from ..compat import CACHE_NAME  # isort: skip

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .gate_spec import DEFAULT_GATE_SPEC, check_gate_shape, normalize_gate_spec, validate_attn_output_ablations
from .presets import from_preset
from .tensor_parallel import tensor_parallel_plan

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class GatedAttentionConfig(PreTrainedConfig):
    r"""Dense decoder-only LM with gated softmax attention.

    `attn_gate` is the gate spec dict (`position`, `granularity`,
    `head_shared`, `mode`, `activation`, `input_dependent`, `bias`, `rank`,
    `input_channels`); omitted keys take their defaults, so `{}` is the
    paper's G1 elementwise sigmoid gate and `None` (or `{"position": None}`)
    is the ungated baseline.

    ```python
    >>> from gated_attention import GatedAttentionConfig
    >>> GatedAttentionConfig(attn_gate={"position": "G1", "granularity": "headwise"}).attn_gate["position"]
    'sdpa'
    ```
    """

    model_type = "gated_attention"
    keys_to_ignore_at_inference = [CACHE_NAME]
    # The layer types this family builds; families with other mixers (the GDN hybrid) extend it.
    allowed_layer_types = ATTENTION_LAYER_TYPES
    # base_model_tp_plan: set per config in __post_init__, to match its gate and layers (see tensor_parallel.py)
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    attention_dropout: float | int = 0.0
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Qwen2/Qwen3's flag. None (a config.json without it) follows sliding_window; False turns a given
    # window off, as in Qwen2; afterwards it always reads `sliding_window is not None`.
    use_sliding_window: bool | None = None
    layer_types: list[str] | None = None
    attn_gate: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_GATE_SPEC))
    attn_output_norm: str | None = None
    attn_output_activation: str | None = None
    # GPT-OSS's learned sink: one logit per query head in its softmax's denominator (`self_attn.sinks`).
    attention_sinks: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    # Named shapes from the papers (see `presets.py`), e.g. `from_preset("dense-1.7b")`.
    from_preset = classmethod(from_preset)

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.use_sliding_window is False:
            self.sliding_window = None
        elif self.use_sliding_window and self.sliding_window is None:
            raise ValueError("use_sliding_window=True needs a sliding_window size")
        self.use_sliding_window = self.sliding_window is not None
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.attn_gate = normalize_gate_spec(self.attn_gate)
        check_gate_shape(self.attn_gate, self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        validate_attn_output_ablations(self.attn_output_norm, self.attn_output_activation)
        if not isinstance(self.attention_sinks, bool):
            raise ValueError(f"attention_sinks={self.attention_sinks!r} is not allowed; allowed values: true, false")
        if any(t not in self.allowed_layer_types for t in self.layer_types):
            raise ValueError(f"layer_types entries must be one of {self.allowed_layer_types}, got {self.layer_types}")
        # Before the base class's __post_init__, which adds the tied embedding's rule to it (transformers 5.17).
        self.base_model_tp_plan = tensor_parallel_plan(self)
        super().__post_init__(**kwargs)
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is None")
