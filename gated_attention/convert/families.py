"""The source families the converter takes, and which one a config.json is.

What each family reads, maps and plans is in `source_config`, `targets` and
`plan`; this module names them and tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .source_config import GATED_MODEL_TYPES
from .sources import ConversionError


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
