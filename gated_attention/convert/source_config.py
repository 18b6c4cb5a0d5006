"""Source configs read as their transformers classes read them, without importing those classes.

The two readers a family record names (`families.Family.reader`), each called with config.json as a dict
and the record: `SourceConfig`, a Llama-family or MoE config.json with the class's defaults, aliases,
derived fields and standardised RoPE; `FlaHybridSource`, an fla `gated_deltanet` config.json with fla's
defaults and its layer plan.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .. import register_auto_classes
from ..hub.remote_code import MODEL_TYPES
from .sources import ConversionError, read_config_dict

GATED_MODEL_TYPES = tuple(MODEL_TYPES)  # a SRC of one of these is read as ours, already gated


# --- source configs, read without transformers' per-family classes ----------------------------------
#
# Importing a family's config class (LlamaConfig, ...) pulls in transformers' model-loading stack:
# 1.5 s of a 2-core machine's time, as much as everything else `convert --no-verify` imports. The
# mapping reads a dozen fields, so config.json is read as the dict it is, with what the family's record
# (`families.FAMILIES`) says of its transformers class: its defaults for the keys config.json leaves out
# (transformers saves only what differs from them), its aliases and derived fields, and RoPE
# standardised by transformers' own mixin.
# tests/test_convert_source_config.py checks every family against the installed transformers' classes,
# on the newest release and on the floor (tests/floor.sh).

_ROPE_KWARGS = ("rope_scaling", "rope_theta", "partial_rotary_factor")  # legacy keys, not fields of the classes
# The types the families' transformers classes declare for their records' defaults. The classes are strict
# dataclasses (huggingface_hub's `@strict`) and refuse a config.json with anything else, so checking the
# same types with the same validator refuses nothing transformers loads; where families differ, the wider
# type is here (None allowed). tests/test_convert_source_config.py checks them against the classes.
SOURCE_TYPES = dict(
    vocab_size=int, hidden_size=int, intermediate_size=int, num_hidden_layers=int, num_attention_heads=int,
    num_key_value_heads=int | None, head_dim=int | None, hidden_act=str, max_position_embeddings=int,
    original_max_position_embeddings=int,
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
    (head_dim, key/value heads, and the record's `derived`) and `rope_parameters` standardised from
    legacy `rope_scaling` / `rope_theta` by transformers' RotaryEmbeddingConfigMixin."""

    def __init__(self, raw: dict, family):  # family: its `families.Family` record
        check_field_types(raw, SOURCE_TYPES)
        raw = copy.deepcopy(raw)  # the RoPE mixin edits rope_parameters in place
        self.model_type = raw["model_type"]
        for alias, name in family.aliases.items():
            if alias in raw:
                raw.setdefault(name, raw.pop(alias))
        rope_kwargs = {k: raw.pop(k) for k in _ROPE_KWARGS if k in raw}
        self.__dict__.update({**family.defaults, **raw})
        self.dtype = _torch_dtype(raw)

        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for derive in family.derived:
            derive(self)
        self.rope_parameters = _standardised_rope(self, family, rope_kwargs)


def _standardised_rope(config: SourceConfig, family, rope_kwargs: dict) -> dict:
    """`rope_parameters` as the family's class makes it: transformers' RoPE mixin run on the config's fields."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    class Fields(RotaryEmbeddingConfigMixin):
        pass

    fields = Fields()
    fields.default_theta = family.default_theta
    fields.__dict__.update({"rope_parameters": None, **vars(config)})
    if family.rope is not None:
        family.rope(fields, rope_kwargs)
    else:
        fields.convert_rope_params_to_dict(**rope_kwargs)
    return fields.rope_parameters


def load_source_config(folder, family):
    """SRC's config, read by the family's `reader`: a `SourceConfig` (Llama family, MoE) or an
    `FlaHybridSource`. Neither imports the family's transformers class (see above), nor fla and its
    CUDA-only kernels.
    """
    try:
        return family.reader(read_config_dict(folder), family)
    except ConversionError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ConversionError(f"SRC config.json could not be read as a {family} config: {e}") from None


# --- fla Gated DeltaNet hybrids (fla's `gated_deltanet` with an `attn` layer list; M-A-P's hybrids) -----

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
    """An fla `gated_deltanet` config.json with fla's defaults (the record's `defaults`) filled in, and its
    layer plan."""

    def __init__(self, config: dict, family):  # family: its `families.Family` record
        check_field_types(config, FLA_GDN_TYPES)
        self.raw = {**family.defaults, **config}
        self.model_type = "gated_deltanet"
        self.dtype = self.raw.get("dtype") or self.raw.get("torch_dtype")
        attn = self.raw["attn"] or {"layers": []}
        if not isinstance(attn.get("layers"), list):
            raise ConversionError("SRC's fla config: `attn` must be a dict with a `layers` list (or null)")
        check_field_types(attn, FLA_ATTN_TYPES, "SRC config.json, attn")
        self.attn = attn
        self.attention_layers = set(attn["layers"])

    def intermediate_size(self) -> int:
        """fla's GatedMLP width: given, or the multiple of 256 nearest above 2/3 * ratio * hidden."""
        r = self.raw
        if r["intermediate_size"] is not None:
            return r["intermediate_size"]
        size = int(r["hidden_size"] * (r["hidden_ratio"] or 4) * 2 / 3)
        return 256 * ((size + 255) // 256)


# --- gated configs (`extend` and `export` read SRC with its own class) ----------------------------------


def _declared_types(config_class) -> dict:
    """Field -> type, as `config_class` and its bases up to transformers' PreTrainedConfig annotate them."""
    import inspect

    from transformers import PreTrainedConfig

    types = {}
    for klass in reversed(config_class.__mro__[: config_class.__mro__.index(PreTrainedConfig)]):
        types.update(inspect.get_annotations(klass, eval_str=True))  # our modules annotate with strings
    return types


def check_config_types(folder: Path) -> None:
    """Name a field of SRC's gated config.json whose value is not of the type its config class declares."""
    from transformers import AutoConfig

    raw = read_config_dict(folder)
    if raw.get("model_type") in GATED_MODEL_TYPES:
        register_auto_classes()
        check_field_types(raw, _declared_types(type(AutoConfig.for_model(raw["model_type"]))))


def load_gated_config(folder: Path):
    """SRC's gated config (`config.json` read by its class), with a field of the wrong type named."""
    from transformers import AutoConfig

    check_config_types(folder)
    try:
        return AutoConfig.from_pretrained(folder)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise ConversionError(f"SRC config.json does not describe a valid gated model: {e}") from None
