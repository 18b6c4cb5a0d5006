"""The tensor names and shapes a target model expects, from a (meta) model or, for a dense model, its config alone."""

from __future__ import annotations

import math

import torch

from .. import register_auto_classes
from ..configuration.gate_spec import gate_enabled, gate_input_width, gate_score_shape
from ..configuration.gated_attention import GatedAttentionConfig


def expected_shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes of a (meta) model, tied copies left out."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def dense_shapes(config: GatedAttentionConfig) -> dict[str, tuple[int, ...]]:
    """`expected_shapes` of a dense gated model, worked out from its config alone, in the model's order.

    The dense layout is Llama's (docs/architecture.md, "Public names") plus the gate, so it can be written down here;
    that lets a conversion that verifies nothing skip importing the modeling code (seconds of
    transformers' modeling stack). tests/test_convert_layout.py checks it against the model itself.
    """
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    qkv_bias = config.attention_bias or config.qkv_bias
    spec = config.attn_gate
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        if config.attention_sinks:  # the attention's own parameter: before its children's
            shapes[f"{attn}sinks"] = (heads,)
        for proj, rows, bias in (("q_proj", heads * head_dim, qkv_bias), ("k_proj", kv_heads * head_dim, qkv_bias),
                                 ("v_proj", kv_heads * head_dim, qkv_bias), ("o_proj", hidden, config.attention_bias)):
            shapes[f"{attn}{proj}.weight"] = (rows, heads * head_dim if proj == "o_proj" else hidden)
            if bias:
                shapes[f"{attn}{proj}.bias"] = (rows,)
        if config.qk_norm:
            shapes[f"{attn}q_norm.weight"] = shapes[f"{attn}k_norm.weight"] = (head_dim,)
        if gate_enabled(spec):  # `AttentionGate`: one score per (head, channel) or per head
            width = math.prod(gate_score_shape(spec, hidden, heads, kv_heads, head_dim))
            reads = gate_input_width(spec, hidden)
            if not spec["input_dependent"]:
                shapes[f"{attn}attn_gate.logits"] = (width,)
            elif spec["rank"]:  # `LowRankAttentionGate`
                shapes[f"{attn}attn_gate.down.weight"] = (spec["rank"], reads)
                shapes[f"{attn}attn_gate.up.weight"] = (width, spec["rank"])
                if spec["bias"]:
                    shapes[f"{attn}attn_gate.up.bias"] = (width,)
            else:
                shapes[f"{attn}attn_gate.weight"] = (width, reads)
                if spec["bias"]:
                    shapes[f"{attn}attn_gate.bias"] = (width,)
        if config.attn_output_norm == "rmsnorm":
            shapes[f"{attn}attn_output_norm.weight"] = (head_dim,)
        mlp = f"model.layers.{i}.mlp."
        for proj, shape in (("gate_proj", (config.intermediate_size, hidden)), ("up_proj", (config.intermediate_size, hidden)),
                            ("down_proj", (hidden, config.intermediate_size))):
            shapes[f"{mlp}{proj}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{mlp}{proj}.bias"] = (shape[0],)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def target_shapes(config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the target model's tensors.

    Dense: worked out from the config (`dense_shapes`), so that `--no-verify` imports no modeling code.
    MoE and hybrid: from the model built on the meta device (no memory), because their expert
    layout is whatever the installed transformers' Qwen3-MoE block is.
    """
    if config.model_type == "gated_attention":
        return dense_shapes(config)
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    with torch.device("meta"):
        return expected_shapes(AutoModelForCausalLM.from_config(config))
