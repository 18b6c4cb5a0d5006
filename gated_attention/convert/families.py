"""Source families: which checkpoints convert, their config mapping and their weight plan.

Each family maps a source `config.json` (read through transformers' own config
class, so legacy `rope_scaling` / `rope_theta` are already standardised) onto
one of our configs, and lists the output tensors: source tensors renamed where
needed, `o_proj` doubled, and the new gate parameters.

Exact init (DESIGN.md, "Function-preserving conversion"): gate weight 0 and no
bias, so every score is sigmoid(0) = 0.5 exactly; `o_proj` is doubled, which
is exact in every float format, so `o_proj(0.5 * y)` with `2 W` is `W y` to
the bit. `--init bias` instead leaves `o_proj` alone and sets a large gate bias
(sigmoid(10) = 1 - 4.5e-5): close to the source, not equal, and the gate's
gradient is scaled by sigmoid'(10) = 4.5e-5.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..configuration.gated_attention import GatedAttentionConfig
from .sources import ConversionError, SourceCheckpoint
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


def load_source_config(folder, family: Family):
    """The source config through transformers' own class (standardises legacy RoPE fields)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read is bad input
        raise ConversionError(f"SRC config.json could not be read as a {family} config: {e}") from None


def _dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


# --- dense: Llama, Mistral, Qwen2, Qwen3 ------------------------------------------------------------


def dense_config(src, family: Family, gate_spec: dict) -> GatedAttentionConfig:
    """The GatedAttentionConfig with the source's fields and the given gate spec."""
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    model_type = src.model_type
    sliding_window = getattr(src, "sliding_window", None)
    layer_types = getattr(src, "layer_types", None)
    if model_type == "mistral":
        layer_types = None  # Mistral windows every layer when sliding_window is set; ours does the same
    elif layer_types is not None:
        layer_types = list(layer_types)
        if "sliding_attention" not in layer_types:
            sliding_window = None  # Qwen2/3 keep a window size around with use_sliding_window=false
    kwargs = dict(
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
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
        layer_types=layer_types,
        attn_gate=gate_spec,
        pad_token_id=getattr(src, "pad_token_id", None),
        bos_token_id=getattr(src, "bos_token_id", None),
        eos_token_id=getattr(src, "eos_token_id", None),
        use_cache=getattr(src, "use_cache", True),
    )
    config = GatedAttentionConfig(**kwargs)
    config.dtype = _dtype_name(getattr(src, "dtype", None))
    return config


def _read(ckpt: SourceCheckpoint, name: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    t = ckpt.read(name)
    if t.dtype != dtype:
        t = t.to(dtype)
    if scale != 1.0:
        t.mul_(scale)  # a power of two: exact in every float format
    return t


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


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ConversionError(f"tensor {name} has shape {list(got)} in SRC but its config implies {list(want)}")


def plan_dense(
    ckpt: SourceCheckpoint,
    model,
    *,
    init: str,
    dtype: torch.dtype | None,
    rename: Callable[[str], str] = lambda name: name,
) -> list[OutputTensor]:
    """Output tensors of a dense (or attention-part of any) conversion, in source order.

    `model` is the target model on the meta device: its state dict says which
    tensors must exist and their shapes. Gate tensors follow their layer's
    `o_proj`, so they land in the same shard as the rest of the layer.
    """
    expected = expected_shapes(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    gate_bias = init == "bias"
    outputs: list[OutputTensor] = []
    present = {rename(n) for n in ckpt.tensors}
    for src_name, info in ckpt.tensors.items():
        if IGNORED_SOURCE_TENSORS.search(src_name) or (tied and src_name == "lm_head.weight"):
            continue  # with tied embeddings the model uses embed_tokens for lm_head, as the source does
        name = rename(src_name)
        if name not in expected:
            raise ConversionError(f"SRC has tensor {src_name}, which a {model.config.model_type} model with this config does not have")
        _check_shape(src_name, info.shape, expected[name])
        out_dtype = _out_dtype(info.dtype, dtype)
        double = init == "exact" and name.endswith("self_attn.o_proj.weight")
        outputs.append(
            OutputTensor(name, info.shape, out_dtype, partial(_read, ckpt, src_name, out_dtype, 2.0 if double else 1.0), [src_name])
        )
        if name.endswith("self_attn.o_proj.weight"):
            prefix = name.removesuffix("o_proj.weight") + "attn_gate."
            for suffix, value in (("weight", 0.0), ("bias", GATE_BIAS_INIT if gate_bias else 0.0)):
                if prefix + suffix in expected and prefix + suffix not in present:
                    shape = expected[prefix + suffix]
                    outputs.append(OutputTensor(prefix + suffix, shape, out_dtype, partial(_full, shape, out_dtype, value)))
    made = {o.name for o in outputs}
    for name, shape in expected.items():
        if name not in made:
            raise ConversionError(f"SRC lacks tensor {name}, which its config implies (shape {list(shape)})")
    return outputs
