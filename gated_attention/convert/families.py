"""Source families: which checkpoints convert, their config mapping and their weight plan.

Each family maps a source `config.json` (read as its transformers class reads
it, defaults and legacy `rope_scaling` / `rope_theta` included: `SourceConfig`)
onto one of our configs, and lists the output tensors: source tensors renamed where
needed, `o_proj` doubled, and the new gate parameters.

Exact init (docs/architecture.md, "The conversion pipeline"): gate weight 0 and no
bias, so every score is sigmoid(0) = 0.5 exactly; `o_proj` is doubled, which
is exact in every float format, so `o_proj(0.5 * y)` with `2 W` is `W y` to
the bit. `--init bias` instead leaves `o_proj` alone and sets a large gate bias
(sigmoid(10) = 1 - 4.5e-5): close to the source, not equal, and the gate's
gradient is scaled by sigmoid'(10) = 4.5e-5.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..configuration.gate_spec import gate_enabled, gate_score_shape
from ..configuration.gated_attention import GatedAttentionConfig
from ..configuration.gated_attention_moe import GatedAttentionMoeConfig
from ..configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig
from .sources import ConversionError, SourceCheckpoint, first_non_finite, read_config_dict
from .writer import OutputTensor

GATE_BIAS_INIT = 10.0  # --init bias: sigmoid(10) = 0.9999546

# Buffers some older checkpoints carry that no model loads.
IGNORED_SOURCE_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")


@dataclass(frozen=True)
class Family:
    """A convertible source family."""

    name: str  # shown to users
    model_types: tuple[str, ...]
    kind: str  # "dense", "moe" or "hybrid"

    def __str__(self) -> str:
        return self.name


FAMILIES = (
    Family("Llama", ("llama",), "dense"),
    Family("Mistral", ("mistral",), "dense"),
    Family("Qwen2/Qwen2.5", ("qwen2",), "dense"),
    Family("Qwen3", ("qwen3",), "dense"),
    Family("Qwen3-MoE", ("qwen3_moe",), "moe"),
    Family("Mixtral", ("mixtral",), "moe"),
    Family("fla Gated DeltaNet hybrid", ("gated_deltanet",), "hybrid"),
)
GATED_MODEL_TYPES = ("gated_attention", "gated_attention_moe", "gated_deltanet_hybrid")


def supported_list() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


def detect_family(config_dict: dict) -> Family:
    model_type = config_dict.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in GATED_MODEL_TYPES:
        raise ConversionError(f"SRC is already a gated model ({model_type}); use `gated-attention extend` to change its RoPE")
    arch = ", ".join(config_dict.get("architectures") or []) or "none listed"
    raise ConversionError(
        f"unsupported architecture: model_type={model_type!r} (architectures: {arch}); supported: {supported_list()}"
    )


# --- source configs, read without transformers' per-family classes ----------------------------------
#
# Importing a family's config class (LlamaConfig, ...) pulls in transformers' model-loading stack:
# 1.5 s of a 2-core machine's time, as much as everything else `convert --no-verify` imports. The
# mapping reads a dozen fields, so config.json is read as the dict it is, with the defaults of the
# family's transformers class for the keys it leaves out (transformers saves only what differs from
# them), the class's own derived fields, and RoPE standardised by transformers' own mixin.
# tests/test_convert_source_config.py checks every family against the installed transformers' classes,
# on the newest release and on the floor (tests/floor.sh).

_LLAMA_LIKE = dict(
    hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
    attention_dropout=0.0, head_dim=None, pad_token_id=None,
)  # fmt: skip
_QWEN = dict(
    _LLAMA_LIKE, vocab_size=151936, max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
SOURCE_DEFAULTS: dict[str, dict] = {
    "llama": dict(
        _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, bos_token_id=1,
        eos_token_id=2, attention_bias=False, mlp_bias=False,
    ),
    "mistral": dict(
        _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, bos_token_id=1,
        eos_token_id=2, sliding_window=4096,
    ),
    "qwen2": dict(
        _QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_window_layers=28, layer_types=None,
    ),
    "qwen3": dict(
        _QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, attention_bias=False, max_window_layers=28, layer_types=None,
    ),
    "qwen3_moe": dict(
        _QWEN, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=768,
        num_experts_per_tok=8, num_experts=128, norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.001, mlp_only_layers=None,
    ),
    "mixtral": dict(
        _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, sliding_window=None, num_experts_per_tok=2, num_local_experts=8,
        output_router_logits=False, router_aux_loss_coef=0.001,
    ),
}  # fmt: skip
# Keys transformers' classes read under another name (their `attribute_map`).
SOURCE_ALIASES = {"qwen3_moe": {"num_local_experts": "num_experts"}, "mixtral": {"num_experts": "num_local_experts"}}
SOURCE_DEFAULT_THETA = {"mixtral": 1e6}  # the class's `default_theta`; 10000 for the others
_ROPE_KWARGS = ("rope_scaling", "rope_theta", "partial_rotary_factor")  # legacy keys, not fields of the classes
# The types the families' transformers classes declare for the fields above. The classes are strict
# dataclasses (huggingface_hub's `@strict`) and refuse a config.json with anything else, so checking the
# same types with the same validator refuses nothing transformers loads; where families differ, the wider
# type is here (None allowed). tests/test_convert_source_config.py checks them against the classes.
SOURCE_TYPES = dict(
    vocab_size=int, hidden_size=int, intermediate_size=int, num_hidden_layers=int, num_attention_heads=int,
    num_key_value_heads=int | None, head_dim=int | None, hidden_act=str, max_position_embeddings=int,
    initializer_range=float, rms_norm_eps=float, use_cache=bool, tie_word_embeddings=bool, attention_bias=bool,
    attention_dropout=float | int | None, mlp_bias=bool, pad_token_id=int | None, bos_token_id=int | None,
    eos_token_id=int | list[int] | None, sliding_window=int | None, use_sliding_window=bool, max_window_layers=int,
    layer_types=list[str] | None, rope_parameters=dict | None, num_experts=int, num_local_experts=int,
    num_experts_per_tok=int, moe_intermediate_size=int, norm_topk_prob=bool, decoder_sparse_step=int,
    mlp_only_layers=list[int] | None, output_router_logits=bool, router_aux_loss_coef=float,
)  # fmt: skip


def check_field_types(raw: dict, types: dict, where: str = "SRC config.json") -> None:
    """ConversionError naming the first field of `raw` whose value is not of its declared type."""
    from huggingface_hub.dataclasses import type_validator  # the validator of transformers' strict configs

    for name, expected in types.items():
        if name not in raw:
            continue
        try:
            type_validator(name, raw[name], expected)
        except TypeError:
            value = raw[name]
            shown = getattr(expected, "__name__", None) or str(expected)
            raise ConversionError(f"{where}: {name} = {value!r} is a {type(value).__name__}, expected {shown}") from None


def _torch_dtype(raw: dict) -> torch.dtype | None:
    """config.json's `dtype` (or legacy `torch_dtype`), as transformers' classes read it."""
    key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
    name = raw.get(key)
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(f"SRC config.json: {key} = {name!r} names no torch dtype, expected a torch dtype such as bfloat16")
    return dtype


class SourceConfig:
    """A Llama-family or MoE config.json as the family's transformers class reads it: attributes are
    the file's keys over the class's defaults, plus the fields the class derives in `__post_init__`
    (head_dim, key/value heads, Qwen's sliding window and layer_types) and `rope_parameters`
    standardised from legacy `rope_scaling` / `rope_theta` by transformers' RotaryEmbeddingConfigMixin."""

    def __init__(self, raw: dict):
        check_field_types(raw, SOURCE_TYPES)
        raw = copy.deepcopy(raw)  # the RoPE mixin edits rope_parameters in place
        self.model_type = model_type = raw["model_type"]
        for alias, name in SOURCE_ALIASES.get(model_type, {}).items():
            if alias in raw:
                raw.setdefault(name, raw.pop(alias))
        rope_kwargs = {k: raw.pop(k) for k in _ROPE_KWARGS if k in raw}
        self.__dict__.update({**SOURCE_DEFAULTS[model_type], **raw})
        self.dtype = _torch_dtype(raw)

        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not self.use_sliding_window:
            self.sliding_window = None
        if model_type in ("qwen2", "qwen3") and self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        if model_type == "qwen3_moe" and self.mlp_only_layers is None:
            self.mlp_only_layers = []
        self.rope_parameters = _standardised_rope(self, SOURCE_DEFAULT_THETA.get(model_type, 1e4), rope_kwargs)


def _standardised_rope(config: SourceConfig, default_theta: float, rope_kwargs: dict) -> dict:
    """`rope_parameters` as the family's class makes it: transformers' RoPE mixin run on the config's fields."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    class Fields(RotaryEmbeddingConfigMixin):
        pass

    fields = Fields()
    fields.default_theta = default_theta
    fields.__dict__.update({"rope_parameters": None, **vars(config)})
    fields.convert_rope_params_to_dict(**rope_kwargs)
    return fields.rope_parameters


def load_source_config(folder, family: Family):
    """SRC's config: a `SourceConfig` (Llama family, MoE) or an fla hybrid's dict with fla's defaults.

    Neither imports the family's transformers class (see above), nor fla and its CUDA-only kernels.
    """
    if family.kind == "hybrid":
        return FlaHybridSource.from_folder(folder)
    try:
        return SourceConfig(read_config_dict(folder))
    except ConversionError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ConversionError(f"SRC config.json could not be read as a {family} config: {e}") from None


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


# --- config mapping ---------------------------------------------------------------------------------


def _attention_kwargs(src, gate_spec: dict) -> dict:
    """The dense fields every family shares (Llama names), from a transformers config."""
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    model_type = src.model_type
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
        qkv_bias=model_type == "qwen2",  # Qwen2: bias on q/k/v, none on o_proj
        attention_dropout=getattr(src, "attention_dropout", 0.0),
        mlp_bias=bool(getattr(src, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        attn_gate=gate_spec,
        pad_token_id=getattr(src, "pad_token_id", None),
        bos_token_id=getattr(src, "bos_token_id", None),
        eos_token_id=getattr(src, "eos_token_id", None),
        use_cache=getattr(src, "use_cache", True),
    )


def dense_config(src, gate_spec: dict) -> GatedAttentionConfig:
    """The GatedAttentionConfig with a Llama / Mistral / Qwen2 / Qwen3 source's fields and the given gate."""
    config = GatedAttentionConfig(**_attention_kwargs(src, gate_spec))
    config.dtype = _dtype_name(getattr(src, "dtype", None))
    return config


def moe_config(src, gate_spec: dict):
    """The GatedAttentionMoeConfig of a Qwen3-MoE or Mixtral source."""
    kwargs = _attention_kwargs(src, gate_spec)
    if src.model_type == "mixtral":
        # Mixtral: every layer sparse, experts as wide as intermediate_size, top-k weights renormalised.
        moe = dict(
            num_experts=src.num_local_experts,
            num_experts_per_tok=src.num_experts_per_tok,
            moe_intermediate_size=src.intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_scores_fp32=True,
        )
    else:
        moe = dict(
            num_experts=src.num_experts,
            num_experts_per_tok=src.num_experts_per_tok,
            moe_intermediate_size=src.moe_intermediate_size,
            norm_topk_prob=src.norm_topk_prob,
            decoder_sparse_step=src.decoder_sparse_step,
            mlp_only_layers=list(src.mlp_only_layers or []),
        )
    moe.update(
        output_router_logits=getattr(src, "output_router_logits", False),
        router_aux_loss_coef=getattr(src, "router_aux_loss_coef", 0.001),
    )
    config = GatedAttentionMoeConfig(**kwargs, **moe)
    config.dtype = _dtype_name(getattr(src, "dtype", None))
    return config


# --- fla Gated DeltaNet hybrids (fla's `gated_deltanet` with an `attn` layer list; M-A-P's hybrids) -----

# fla's GatedDeltaNetConfig defaults, for keys a config.json leaves out.
FLA_GDN_DEFAULTS = dict(
    hidden_size=2048, expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
    head_dim=256, num_heads=6, num_v_heads=None, max_position_embeddings=2048, hidden_ratio=4,
    intermediate_size=None, hidden_act="swish", num_hidden_layers=21, norm_eps=1e-6, attn=None, use_cache=True,
    pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02,
    vocab_size=32000, attnres_block_size=None, output_gate_activation="swish",
)  # fmt: skip


# The types of fla's GatedDeltaNetConfig arguments (its signature's annotations; tests/test_convert_source_config.py
# checks them where fla is installed). fla does not enforce them, so a float may also be written as an int.
_NUMBER = float | int
FLA_GDN_TYPES = dict(
    hidden_size=int, expand_v=_NUMBER, use_gate=bool, use_short_conv=bool, allow_neg_eigval=bool, conv_size=int,
    head_dim=int, num_heads=int, num_v_heads=int | None, max_position_embeddings=int, hidden_ratio=int | None,
    intermediate_size=int | None, hidden_act=str, num_hidden_layers=int, norm_eps=_NUMBER, attn=dict | None,
    use_cache=bool, pad_token_id=int | None, bos_token_id=int | None, eos_token_id=int | None,
    tie_word_embeddings=bool, initializer_range=_NUMBER, vocab_size=int, attnres_block_size=int | None,
    output_gate_activation=str,
)  # fmt: skip
# fla's `attn` dict, as its `get_attention` reads it
FLA_ATTN_TYPES = dict(
    layers=list[int], num_heads=int, num_kv_heads=int | None, qkv_bias=bool, qk_norm=bool, window_size=int | None,
    rope_theta=_NUMBER | None,
)  # fmt: skip


class FlaHybridSource:
    """An fla `gated_deltanet` config.json with fla's defaults filled in, and its layer plan."""

    def __init__(self, config: dict):
        check_field_types(config, FLA_GDN_TYPES)
        self.raw = {**FLA_GDN_DEFAULTS, **config}
        self.model_type = "gated_deltanet"
        self.dtype = self.raw.get("dtype") or self.raw.get("torch_dtype")
        attn = self.raw["attn"] or {"layers": []}
        if not isinstance(attn.get("layers"), list):
            raise ConversionError("SRC's fla config: `attn` must be a dict with a `layers` list (or null)")
        check_field_types(attn, FLA_ATTN_TYPES, "SRC config.json, attn")
        self.attn = attn
        self.attention_layers = set(attn["layers"])

    @classmethod
    def from_folder(cls, folder) -> FlaHybridSource:
        return cls(read_config_dict(folder))

    def unsupported(self) -> str | None:
        r = self.raw
        if not r["use_short_conv"]:
            return "use_short_conv=false (the Gated DeltaNet layer here always has its short convolutions)"
        if r["allow_neg_eigval"]:
            return "allow_neg_eigval=true (beta in [0, 2]) is not implemented by the hybrid model"
        if r["use_gate"] and r["output_gate_activation"] not in ("swish", "silu"):
            return f"output_gate_activation={r['output_gate_activation']!r} (only swish/silu)"
        if r["attnres_block_size"] is not None:
            return "attention residuals (attnres_block_size) are not implemented by the hybrid model"
        if r["hidden_act"] not in ("swish", "silu"):
            return f"hidden_act={r['hidden_act']!r} (only swish/silu)"
        if self.attn.get("qk_norm"):
            return "attn.qk_norm=true"  # fla's get_attention never passes it on; refuse rather than guess
        return None

    def intermediate_size(self) -> int:
        """fla's GatedMLP width: given, or the multiple of 256 nearest above 2/3 * ratio * hidden."""
        r = self.raw
        if r["intermediate_size"] is not None:
            return r["intermediate_size"]
        size = int(r["hidden_size"] * (r["hidden_ratio"] or 4) * 2 / 3)
        return 256 * ((size + 255) // 256)

    def target_name(self, name: str) -> str:
        """fla parameter name -> ours: embeddings, block norms, and `attn` by layer type."""
        if name == "model.embeddings.weight":
            return "model.embed_tokens.weight"
        m = re.match(r"^model\.layers\.(\d+)\.(attn_norm|mlp_norm|attn)\.(.*)$", name)
        if not m:
            return name
        layer, part, rest = int(m[1]), m[2], m[3]
        if part == "attn":
            part = "self_attn" if layer in self.attention_layers else "linear_attn"
        else:
            part = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}[part]
        return f"model.layers.{layer}.{part}.{rest}"


def hybrid_config(src: FlaHybridSource, gate_spec: dict):
    if (reason := src.unsupported()) is not None:
        raise ConversionError(f"SRC's fla Gated DeltaNet config is not supported: {reason}")
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


def target_config(src, family: Family, gate_spec: dict):
    build = {"dense": dense_config, "moe": moe_config, "hybrid": hybrid_config}[family.kind]
    try:
        return build(src, gate_spec)
    except ConversionError:
        raise
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:  # a config.json no model can have
        raise ConversionError(f"SRC config.json does not describe a valid {family} model: {e}") from None


# --- weight plan -------------------------------------------------------------------------------------

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Per-expert tensors (the layout transformers 5 still saves for Qwen3-MoE and Mixtral) fused into
# our Qwen3-MoE in-memory layout: gate_up_proj [E, 2I, H] (expert e = gate_e rows then up_e rows)
# and down_proj [E, H, I].
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def source_to_target_name(name: str) -> str:
    """Mixtral's saved names -> Qwen3-MoE names; everything else is already a target name."""
    m = _MIXTRAL_EXPERT.search(name)
    if m:
        return name[: m.start()] + f".mlp.experts.{m.group(1)}.{_MIXTRAL_NAMES[m.group(2)]}.weight"
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def _read(ckpt: SourceCheckpoint, name: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    source = t = ckpt.read(name)
    if t.dtype != dtype:
        t = t.to(dtype)
    if scale != 1.0:
        # A power of two: exact in every float format. Out of place: writing into the file's private
        # mapping faults page by page (copy on write), 15x slower than a fresh product on this machine.
        t = t * scale
    if t is not source and (i := first_non_finite(t)) is not None:  # SRC is finite (checked): this made the inf
        value = source.reshape(-1)[i].item()
        where = [int(k) for k in np.unravel_index(i, source.shape)]
        cause = (
            f"{str(dtype).removeprefix('torch.')} cannot hold it (--dtype)"
            if not torch.isfinite(source.reshape(-1)[i : i + 1].to(dtype)).all()
            else "doubling o_proj (--init exact) makes it inf; --init bias leaves o_proj as it is"
        )
        raise ConversionError(f"SRC tensor {name} holds {value:g} at {where}: {cause}")
    return t


def _read_each(ckpt: SourceCheckpoint, names: list[str], dtype: torch.dtype):
    for name in names:  # one expert matrix in memory at a time
        yield _read(ckpt, name, dtype)


def _full(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


def _out_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    return requested if requested is not None and source.is_floating_point else source


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
        for proj, rows, bias in (("q_proj", heads * head_dim, qkv_bias), ("k_proj", kv_heads * head_dim, qkv_bias),
                                 ("v_proj", kv_heads * head_dim, qkv_bias), ("o_proj", hidden, config.attention_bias)):
            shapes[f"{attn}{proj}.weight"] = (rows, heads * head_dim if proj == "o_proj" else hidden)
            if bias:
                shapes[f"{attn}{proj}.bias"] = (rows,)
        if config.qk_norm:
            shapes[f"{attn}q_norm.weight"] = shapes[f"{attn}k_norm.weight"] = (head_dim,)
        if gate_enabled(spec):  # `AttentionGate`: one score per (head, channel) or per head
            width = math.prod(gate_score_shape(spec, hidden, heads, kv_heads, head_dim))
            if spec["input_dependent"]:
                shapes[f"{attn}attn_gate.weight"] = (width, hidden)
                if spec["bias"]:
                    shapes[f"{attn}attn_gate.bias"] = (width,)
            else:
                shapes[f"{attn}attn_gate.logits"] = (width,)
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


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ConversionError(f"tensor {name} has shape {list(got)} in SRC but its config implies {list(want)}")


def _fused_experts(ckpt: SourceCheckpoint, grouped: dict, dtype, expected) -> list[OutputTensor]:
    """Output tensors for per-expert source tensors, grouped as {(prefix): {expert: {proj: source name}}}."""
    outputs = []
    for prefix, experts in grouped.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise ConversionError(f"SRC's experts under {prefix} are numbered {ids[:8]}..., not 0..{len(ids) - 1}")
        for target, projs in ((f"{prefix}.gate_up_proj", ("gate_proj", "up_proj")), (f"{prefix}.down_proj", ("down_proj",))):
            names = []
            for e in ids:
                for proj in projs:
                    if proj not in experts[e]:
                        raise ConversionError(f"SRC lacks tensor {prefix}.{e}.{proj}.weight (expert {e} is incomplete)")
                    names.append(experts[e][proj])
            if target not in expected:
                raise ConversionError(f"SRC has experts under {prefix}, which a model with this config does not have")
            rows, cols = ckpt.tensors[names[0]].shape
            for n in names:
                _check_shape(n, ckpt.tensors[n].shape, (rows, cols))
            _check_shape(f"{prefix}.*.{'/'.join(projs)} (fused)", (len(ids), rows * len(projs), cols), expected[target])
            out_dtype = _out_dtype(ckpt.tensors[names[0]].dtype, dtype)
            outputs.append(OutputTensor(target, expected[target], out_dtype, partial(_read_each, ckpt, names, out_dtype), names))
    return outputs


def plan_weights(
    ckpt: SourceCheckpoint,
    expected: dict[str, tuple[int, ...]],
    config,
    *,
    init: str,
    dtype: torch.dtype | None,
    rename=source_to_target_name,
) -> list[OutputTensor]:
    """Output tensors of a conversion (`init` "exact" or "bias") or a copy (`init` "copy"), in source order.

    `expected` is the target model's `expected_shapes` (or `dense_shapes`) for
    `config`: which tensors must exist and their shapes, so every name and
    shape is checked before anything is written. Gate tensors follow their
    layer's `o_proj`, so they land in the same shard as the rest of the layer.
    """
    tied = getattr(config, "tie_word_embeddings", False)
    renamed = {src_name: rename(src_name) for src_name in ckpt.tensors}
    present = set(renamed.values())
    outputs: list[OutputTensor | str] = []  # a str marks where a layer's fused experts go
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for src_name, info in ckpt.tensors.items():
        if IGNORED_SOURCE_TENSORS.search(src_name) or (tied and src_name == "lm_head.weight"):
            continue  # with tied embeddings the model uses embed_tokens for lm_head, as the source does
        name = renamed[src_name]
        m = _PER_EXPERT.match(name)
        if m:
            layer = experts.setdefault(m["prefix"], {})
            if not layer:  # the fused tensors go where the layer's first expert was
                outputs.append(m["prefix"])
            layer.setdefault(int(m["expert"]), {})[m["proj"]] = src_name
            continue
        if name not in expected:
            raise ConversionError(f"SRC has tensor {src_name}, which a {config.model_type} model with this config does not have")
        _check_shape(src_name, info.shape, expected[name])
        out_dtype = _out_dtype(info.dtype, dtype)
        double = init == "exact" and name.endswith("self_attn.o_proj.weight")
        unchanged = ckpt.format == "safetensors" and out_dtype == info.dtype and not double
        make = partial(_read, ckpt, src_name, out_dtype, 2.0 if double else 1.0)
        outputs.append(OutputTensor(name, info.shape, out_dtype, make, [src_name], copy_of=info if unchanged else None))
        if name.endswith("self_attn.o_proj.weight"):
            prefix = name.removesuffix("o_proj.weight") + "attn_gate."
            for suffix, value in (("weight", 0.0), ("bias", GATE_BIAS_INIT if init == "bias" else 0.0)):
                if prefix + suffix in expected and prefix + suffix not in present:
                    shape = expected[prefix + suffix]
                    make = partial(_full, shape, out_dtype, value)
                    zeros = value == 0.0 and math.copysign(1.0, value) > 0
                    outputs.append(OutputTensor(prefix + suffix, shape, out_dtype, make, zeros=zeros))
    fused = {o.name: o for o in _fused_experts(ckpt, experts, dtype, expected)}
    planned: list[OutputTensor] = []
    for item in outputs:
        planned.extend([fused[f"{item}.gate_up_proj"], fused[f"{item}.down_proj"]] if isinstance(item, str) else [item])
    made = {o.name for o in planned}
    for name, shape in expected.items():
        if name not in made:
            raise ConversionError(f"SRC lacks tensor {name}, which its config implies (shape {list(shape)})")
    return planned
