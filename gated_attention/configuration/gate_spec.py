"""The attention gate spec (`config.attn_gate`) and its validation.

The spec is a plain JSON-able dict so it survives `config.json` unchanged. Every
config family (dense, MoE, hybrid) stores it normalised: all keys present,
aliases resolved. Position names follow the Gated Attention paper's Figure 1:

    G1 "sdpa"   the SDPA output, per query head          [B, T, HQ, D]
    G2 "value"  the value projection, per key/value head  [B, T, HKV, D]
    G3 "key"    the key projection, per key/value head    [B, T, HKV, D]
    G4 "query"  the query projection, per query head      [B, T, HQ, D]
    G5 "dense"  the output projection (o_proj)            [B, T, hidden_size]

`gate_score_shape` is the one place that works out how many scores a spec
makes; the model, the converter and the export all call it.

Two keys shape the projection rather than the scores: `rank` (a low-rank gate,
`act(X W_down^T W_up^T)` with `W_down` `[rank, d]` and `W_up` `[scores, rank]`)
and `input_channels` (the gate reads only the first d channels of X, as
marin's 1/16-truncated gate and modded-nanogpt's 12-channel gate do).
`check_gate_shape` checks them against the model's widths.
"""

from __future__ import annotations

import math
from typing import Any

GATE_NAME = "attn_gate"  # the config key and the gate module's name; never `gate` or `gate_proj` (PEFT matches by suffix)
GATE_POSITIONS = ("sdpa", "value", "key", "query", "dense")
GATE_ALIASES = {"G1": "sdpa", "G2": "value", "G3": "key", "G4": "query", "G5": "dense"}
GATE_GRANULARITIES = ("elementwise", "headwise")
GATE_MODES = ("multiplicative", "additive")
GATE_ACTIVATION_NAMES = ("sigmoid", "silu", "ns_sigmoid")  # kernels.gated_sdpa.gate_activations holds their functions
ATTN_OUTPUT_NORMS = (None, "rmsnorm")
ATTN_OUTPUT_ACTIVATIONS = (None, "silu")

DEFAULT_GATE_SPEC: dict[str, Any] = {
    "position": "sdpa",
    "granularity": "elementwise",
    "head_shared": False,
    "mode": "multiplicative",
    "activation": "sigmoid",
    "input_dependent": True,
    "bias": False,
    "rank": None,
    "input_channels": None,
}
NO_GATE_SPEC: dict[str, Any] = {**DEFAULT_GATE_SPEC, "position": None}


def _choice(key: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        shown = ", ".join("null" if a is None else repr(a) for a in allowed)
        raise ValueError(f"attn_gate.{key}={value!r} is not allowed; allowed values: {shown}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"attn_gate.{key}={value!r} is not allowed; allowed values: true, false")
    return value


def _width(key: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"attn_gate.{key}={value!r} is not allowed; allowed values: null or a positive int")
    return value


def normalize_gate_spec(spec: dict[str, Any] | None) -> dict[str, Any]:
    """Return the full, validated gate spec for `spec`.

    `None` means no gate (the paper's baseline); a dict fills missing keys from
    `DEFAULT_GATE_SPEC`. Raises `ValueError` naming the offending key and the
    allowed values.
    """
    if spec is None:
        return dict(NO_GATE_SPEC)
    if not isinstance(spec, dict):
        raise ValueError(f"attn_gate must be a dict or null, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(DEFAULT_GATE_SPEC))
    if unknown:
        raise ValueError(f"attn_gate: unknown key {unknown[0]!r}; allowed keys: {', '.join(DEFAULT_GATE_SPEC)}")

    out = {**DEFAULT_GATE_SPEC, **spec}
    position = out["position"]
    if isinstance(position, str) and position.upper() in GATE_ALIASES:
        position = GATE_ALIASES[position.upper()]
    out["position"] = _choice("position", position, (*GATE_POSITIONS, None, *GATE_ALIASES))
    _choice("granularity", out["granularity"], GATE_GRANULARITIES)
    _choice("mode", out["mode"], GATE_MODES)
    _choice("activation", out["activation"], GATE_ACTIVATION_NAMES)
    for key in ("head_shared", "input_dependent", "bias"):
        _flag(key, out[key])
    for key in ("rank", "input_channels"):
        _width(key, out[key])

    # The paper pairs SiLU (unbounded) with additive gating and sigmoid (in [0, 1])
    # with multiplicative gating; the other two pairings are not gates.
    if out["activation"] == "silu" and out["mode"] != "additive":
        raise ValueError(
            "attn_gate.activation='silu' is unbounded and needs mode='additive'; "
            "allowed activations for mode='multiplicative': 'sigmoid', 'ns_sigmoid'"
        )
    if out["mode"] == "additive" and out["activation"] != "silu":
        raise ValueError(
            f"attn_gate.activation={out['activation']!r} is not allowed with mode='additive'; "
            "allowed values: 'silu'"
        )
    if out["position"] == "dense" and (out["granularity"] != "elementwise" or out["head_shared"]):
        raise ValueError(
            "attn_gate.granularity='headwise' and head_shared=true need a per-head position; "
            "allowed positions: 'sdpa', 'value', 'key', 'query' (G5 'dense' gates o_proj's output, which has no heads)"
        )
    if out["bias"] and not out["input_dependent"]:
        raise ValueError(
            "attn_gate.bias=true needs input_dependent=true (an input-independent gate is itself a learned constant)"
        )
    for key in ("rank", "input_channels"):
        if out[key] is not None and not out["input_dependent"]:
            raise ValueError(f"attn_gate.{key}={out[key]} needs input_dependent=true (an input-independent gate has no projection)")
    return out


def gate_enabled(spec: dict[str, Any]) -> bool:
    return spec.get("position") is not None


def gate_score_shape(
    spec: dict[str, Any], hidden_size: int, num_heads: int, num_key_value_heads: int, head_dim: int
) -> tuple[int, ...]:
    """The scores one token gets from an enabled, normalised spec, before they are broadcast.

    `(hidden_size,)` for G5 "dense"; otherwise `(heads, width)`: heads is 1 when
    `head_shared`, else the gated tensor's heads (key/value heads for G2/G3,
    query heads for G1/G4), and width is `head_dim` elementwise, 1 headwise.
    The gate's projection makes them flat, heads first then channels: its
    weight is `[math.prod(shape), hidden_size]`.
    """
    if spec["position"] == "dense":
        return (hidden_size,)
    heads = 1 if spec["head_shared"] else (num_key_value_heads if spec["position"] in ("key", "value") else num_heads)
    return (heads, head_dim if spec["granularity"] == "elementwise" else 1)


def gate_input_width(spec: dict[str, Any], hidden_size: int) -> int:
    """How many channels of the layer input X the gate's projection reads: `input_channels`, or all of them."""
    return spec["input_channels"] or hidden_size


def check_gate_shape(
    spec: dict[str, Any], hidden_size: int, num_heads: int, num_key_value_heads: int, head_dim: int
) -> None:
    """One-line `ValueError`s for `rank` and `input_channels` that do not fit the model's widths."""
    if not gate_enabled(spec):
        return
    if spec["input_channels"] is not None and spec["input_channels"] > hidden_size:
        raise ValueError(
            f"attn_gate.input_channels={spec['input_channels']} is more than the {hidden_size} channels of the layer "
            f"input (hidden_size)"
        )
    rank = spec["rank"]
    if rank is not None:
        scores = math.prod(gate_score_shape(spec, hidden_size, num_heads, num_key_value_heads, head_dim))
        full = min(gate_input_width(spec, hidden_size), scores)
        if rank >= full:
            raise ValueError(
                f"attn_gate.rank={rank} is not below {full}, the rank of the full gate ({scores} scores from "
                f"{gate_input_width(spec, hidden_size)} input channels); use rank null for the full gate"
            )


def validate_attn_output_ablations(norm: str | None, activation: str | None) -> None:
    if norm not in ATTN_OUTPUT_NORMS:
        raise ValueError(f"attn_output_norm={norm!r} is not allowed; allowed values: null, 'rmsnorm'")
    if activation not in ATTN_OUTPUT_ACTIVATIONS:
        raise ValueError(f"attn_output_activation={activation!r} is not allowed; allowed values: null, 'silu'")
