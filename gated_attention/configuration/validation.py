"""The architecture fields of a `config.json`, checked before anything is allocated. Standard library only.

Every command and example reads a config before it builds a model or a weight plan from it, and an absurd
value there would otherwise be found late and badly: a million layers allocate for minutes (or hang, growing),
`head_dim: 0` divides by zero or is silently replaced by `hidden_size // num_attention_heads`, a hidden size
the heads do not divide ends in a shape mismatch that names no field. `check_architecture` answers at once,
in one line naming the field and its value.

It reads the names transformers' Llama/Qwen/Mixtral/Qwen3-MoE configs use (ours included), the Gated
DeltaNet fields of our hybrid and fla's names; a field that is absent or None is left to its config class
(None means "derive it", as `head_dim` and `num_key_value_heads` do). The upper bounds are far beyond any
published model: they are there to tell a typo from a model, not to police sizes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

MAX_LAYERS = 10_000  # the deepest published LMs have a few hundred
MAX_WIDTH = 2**20  # hidden, intermediate and head sizes
MAX_COUNT = 2**16  # heads, experts, convolution width
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**31 - 1

# field -> (lowest allowed value, highest allowed value)
SIZE_FIELDS = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, MAX_WIDTH),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_COUNT),
    "num_key_value_heads": (1, MAX_COUNT),
    "head_dim": (1, MAX_WIDTH),
    "max_position_embeddings": (1, MAX_POSITIONS),
    # MoE (Qwen3-MoE / Mixtral / ours)
    "num_experts": (0, MAX_COUNT),
    "num_local_experts": (0, MAX_COUNT),
    "num_experts_per_tok": (1, MAX_COUNT),
    "moe_intermediate_size": (1, MAX_WIDTH),
    "shared_expert_intermediate_size": (0, MAX_WIDTH),
    "decoder_sparse_step": (1, MAX_LAYERS),
    # Gated DeltaNet (ours, Qwen3-Next names)
    "linear_num_key_heads": (1, MAX_COUNT),
    "linear_num_value_heads": (1, MAX_COUNT),
    "linear_key_head_dim": (1, MAX_WIDTH),
    "linear_value_head_dim": (1, MAX_WIDTH),
    "linear_conv_kernel_dim": (1, MAX_COUNT),
    # fla's Gated DeltaNet names
    "num_heads": (1, MAX_COUNT),
    "num_v_heads": (1, MAX_COUNT),
    "num_kv_heads": (1, MAX_COUNT),
    "conv_size": (1, MAX_COUNT),
}


class ConfigError(ValueError):
    """A config field no model can have; the message is one line naming the field and its value."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(config: Mapping, where: str) -> None:
    for name, (low, high) in SIZE_FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, list) and value and all(_is_int(v) for v in value):
            value = max(value) if max(value) > high else min(value)  # one per layer (Gemma 3n's intermediate_size)
        if not _is_int(value):
            raise ConfigError(f"{where}: {name} = {value!r} is a {type(value).__name__}, expected int "
                              f"(a whole number from {low} to {high})")
        if value < low:
            raise ConfigError(f"{where}: {name} = {value}: expected at least {low}")
        if value > high:
            raise ConfigError(f"{where}: {name} = {value}: expected at most {high} (no model has that many; a typo?)")


def _check_relations(config: Mapping, where: str) -> None:
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads) and heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}")
    hidden = config.get("hidden_size")
    if _is_int(heads) and _is_int(hidden) and config.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size = {hidden} is not divisible by num_attention_heads = {heads}, and no "
                          "head_dim is given to say the head size")
    experts = config.get("num_experts", config.get("num_local_experts"))
    per_token = config.get("num_experts_per_tok")
    if _is_int(experts) and experts and _is_int(per_token) and per_token > experts:
        raise ConfigError(f"{where}: num_experts_per_tok = {per_token} is more than the {experts} experts")
    layers, layer_types = config.get("num_hidden_layers"), config.get("layer_types")
    if layers is not None and isinstance(layer_types, list) and len(layer_types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for num_hidden_layers = {layers}")
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), Mapping) else {}
    for name, theta in (("rope_theta", config.get("rope_theta")), ("rope_parameters.rope_theta", rope.get("rope_theta"))):
        if theta is not None and not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ConfigError(f"{where}: {name} = {theta!r}: expected a positive number")


def check_architecture(config, where: str = "config.json") -> None:
    """ConfigError, one line naming the field and its value, if `config` (a config.json dict, or a config
    object) has a size no model can have: a count or size below 1 or absurdly large, heads that do not
    divide, a head size of 0. fla's nested `attn` block is checked too."""
    if not isinstance(config, Mapping):
        config = config.to_dict()
    _check_sizes(config, where)
    _check_relations(config, where)
    attn = config.get("attn")
    if isinstance(attn, Mapping):  # fla: the softmax-attention layers' own heads
        _check_sizes(attn, f"{where}, attn")


def check_config_file(folder, where: str | None = None) -> None:
    """`check_architecture` of `folder/config.json`, where there is one that reads as a JSON object
    (a missing or broken one is for the caller's loader to name)."""
    path = Path(folder).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(config, dict):
        check_architecture(config, where or str(path))
