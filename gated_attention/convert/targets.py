"""Source configs mapped onto our configs: dense, MoE or hybrid, with the gate a conversion adds.

The fields every Llama-like family shares are read here by their Llama
names; what is fixed for a family, or read from another field, is its
record's `target` (`families.Family`)."""

from __future__ import annotations

from functools import partial

from ..configuration.gated_attention import GatedAttentionConfig
from ..configuration.gated_attention_moe import GatedAttentionMoeConfig
from ..configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig
from .families import Family, From
from .source_config import FlaHybridSource
from .sources import ConversionError


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _attention_kwargs(src, gate_spec: dict) -> dict:
    """The dense fields every family shares (Llama names), from a transformers config."""
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    sliding_window = getattr(src, "sliding_window", None)
    layer_types = getattr(src, "layer_types", None)
    if layer_types is not None:
        layer_types = list(layer_types)
        if "sliding_attention" not in layer_types:
            sliding_window = None  # Qwen2/3 keep a window size around with use_sliding_window=false
    # else (Mistral, Mixtral, Qwen3-MoE): sliding_window, when set, windows every layer, as ours does with layer_types=None
    return dict(
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=getattr(src, "num_key_value_heads", None) or src.num_attention_heads,
        head_dim=head_dim,
        hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings,
        initializer_range=getattr(src, "initializer_range", 0.02),
        rms_norm_eps=src.rms_norm_eps,
        tie_word_embeddings=bool(getattr(src, "tie_word_embeddings", False)),
        rope_parameters=dict(src.rope_parameters),
        attention_bias=bool(getattr(src, "attention_bias", False)),
        qkv_bias=False,
        attention_dropout=getattr(src, "attention_dropout", 0.0),
        mlp_bias=bool(getattr(src, "mlp_bias", False)),
        qk_norm=False,
        sliding_window=sliding_window,
        layer_types=layer_types,
        attn_gate=gate_spec,
        pad_token_id=getattr(src, "pad_token_id", None),
        bos_token_id=getattr(src, "bos_token_id", None),
        eos_token_id=getattr(src, "eos_token_id", None),
        use_cache=getattr(src, "use_cache", True),
    )


def _record_fields(src, family: Family) -> dict:
    """The record's `target`: fixed values, and `From` fields read from the source (lists copied); a record
    whose fields follow from the source as a whole (the paper's flags) gives a function of it instead."""
    fields = {}
    target = family.target(src) if callable(family.target) else family.target
    for name, value in target.items():
        if isinstance(value, From):
            value = getattr(src, value.field)
        fields[name] = list(value) if isinstance(value, (list, tuple)) else value
    return fields


def llama_like_config(config_class, src, family: Family, gate_spec: dict):
    """Our dense or MoE config (`config_class`) of a Llama-like source, with the given gate: the shared
    fields by their Llama names, then the record's `target` (an MoE's expert fields, a family's biases)."""
    config = config_class(**{**_attention_kwargs(src, gate_spec), **_record_fields(src, family)})
    config.dtype = _dtype_name(getattr(src, "dtype", None))
    return config


def hybrid_config(src: FlaHybridSource, family: Family, gate_spec: dict) -> GatedDeltaNetHybridConfig:
    """Our hybrid config of an fla Gated DeltaNet hybrid, read by fla's names."""
    r, attn = src.raw, src.attn
    L = r["num_hidden_layers"]
    window = attn.get("window_size")
    layer_types = [
        ("sliding_attention" if window else "full_attention") if i in src.attention_layers else "linear_attention"
        for i in range(L)
    ]
    num_heads = attn.get("num_heads") or 1  # unused when there are no attention layers
    config = GatedDeltaNetHybridConfig(
        vocab_size=r["vocab_size"],
        hidden_size=r["hidden_size"],
        intermediate_size=src.intermediate_size(),
        num_hidden_layers=L,
        num_attention_heads=num_heads,
        num_key_value_heads=attn.get("num_kv_heads") or num_heads,
        head_dim=r["hidden_size"] // num_heads,  # fla's Attention: hidden_size / num_heads
        hidden_act="silu",
        max_position_embeddings=r["max_position_embeddings"],
        initializer_range=r["initializer_range"],
        rms_norm_eps=r["norm_eps"],
        tie_word_embeddings=r["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(attn.get("rope_theta") or 10000.0)},
        qkv_bias=bool(attn.get("qkv_bias", False)),  # fla: bias on q/k/v, never on o_proj
        sliding_window=window,
        layer_types=layer_types,
        attn_gate=gate_spec,
        linear_num_key_heads=r["num_heads"],
        linear_num_value_heads=r["num_v_heads"] or r["num_heads"],
        linear_key_head_dim=r["head_dim"],
        linear_value_head_dim=int(r["head_dim"] * r["expand_v"]),
        linear_conv_kernel_dim=r["conv_size"],
        linear_output_gate=r["use_gate"],
        pad_token_id=r["pad_token_id"],
        bos_token_id=r["bos_token_id"],
        eos_token_id=r["eos_token_id"],
        use_cache=r["use_cache"],
    )
    config.dtype = _dtype_name(src.dtype)
    return config


# A record's `kind` -> what builds our config from its source config.
BUILDERS = {
    "dense": partial(llama_like_config, GatedAttentionConfig),
    "moe": partial(llama_like_config, GatedAttentionMoeConfig),
    "hybrid": hybrid_config,
}


def target_config(src, family: Family, gate_spec: dict):
    """Our config for `src` (a `SourceConfig`, a transformers config, or an `FlaHybridSource`)."""
    for check in family.unsupported:
        if (reason := check(src)) is not None:
            raise ConversionError(f"SRC's {family} config is not supported: {reason}")
    build = BUILDERS[family.kind]
    try:
        return build(src, family, gate_spec)
    except ConversionError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:  # a config.json no model can have
        raise ConversionError(f"SRC config.json does not describe a valid {family} model: {e}") from None
