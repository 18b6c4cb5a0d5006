"""The gate spec: normalisation, aliases, the documented errors, the score shapes and the activation tables."""

import json

import pytest
import torch

from gated_attention import DEFAULT_GATE_SPEC, GatedAttentionConfig, normalize_gate_spec
from gated_attention.configuration.gate_spec import GATE_ACTIVATION_NAMES, gate_score_shape
from gated_attention.kernels.gated_sdpa.gate_activations import FUSED_GATE_ACTIVATIONS, GATE_ACTIVATION_FUNCTIONS
from gated_attention.kernels.gated_sdpa.triton import ACTIVATION_CODES


def test_defaults_are_the_papers_g1_gate():
    assert normalize_gate_spec({}) == DEFAULT_GATE_SPEC
    assert DEFAULT_GATE_SPEC["position"] == "sdpa"
    assert DEFAULT_GATE_SPEC["activation"] == "sigmoid"
    assert DEFAULT_GATE_SPEC["mode"] == "multiplicative"


def test_none_is_the_ungated_baseline():
    assert normalize_gate_spec(None)["position"] is None
    assert GatedAttentionConfig(attn_gate=None).attn_gate["position"] is None


@pytest.mark.parametrize(
    "alias, position", [("G1", "sdpa"), ("G2", "value"), ("G3", "key"), ("g4", "query"), ("G5", "dense")]
)
def test_aliases(alias, position):
    assert normalize_gate_spec({"position": alias})["position"] == position


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"colour": "red"}, "unknown key 'colour'; allowed keys: position, granularity"),
        ({"position": "G6"}, "attn_gate.position='G6' is not allowed; allowed values: 'sdpa', 'value'"),
        ({"granularity": "channelwise"}, "attn_gate.granularity='channelwise' is not allowed"),
        ({"mode": "mult"}, "attn_gate.mode='mult' is not allowed; allowed values: 'multiplicative', 'additive'"),
        ({"activation": "tanh"}, "attn_gate.activation='tanh' is not allowed; allowed values: 'sigmoid'"),
        ({"head_shared": "yes"}, "attn_gate.head_shared='yes' is not allowed; allowed values: true, false"),
        ({"activation": "silu"}, "activation='silu' is unbounded and needs mode='additive'"),
        ({"mode": "additive"}, "activation='sigmoid' is not allowed with mode='additive'; allowed values: 'silu'"),
        ({"position": "G5", "granularity": "headwise"}, "need a per-head position"),
        ({"position": "dense", "head_shared": True}, "need a per-head position"),
        ({"input_dependent": False, "bias": True}, "bias=true needs input_dependent=true"),
        ({"rank": 0}, "attn_gate.rank=0 is not allowed; allowed values: null or a positive int"),
        ({"rank": True}, "attn_gate.rank=True is not allowed; allowed values: null or a positive int"),
        ({"input_channels": "12"}, "attn_gate.input_channels='12' is not allowed; allowed values: null or a positive"),
        ({"input_dependent": False, "rank": 4}, "attn_gate.rank=4 needs input_dependent=true"),
        ({"input_dependent": False, "input_channels": 8}, "attn_gate.input_channels=8 needs input_dependent=true"),
        # The default config: hidden 2048, 16 heads of 128.
        ({"input_channels": 4096}, "attn_gate.input_channels=4096 is more than the 2048 channels of the layer input"),
        ({"rank": 2048}, "attn_gate.rank=2048 is not below 2048, the rank of the full gate (2048 scores from 2048 "),
        ({"granularity": "headwise", "rank": 16}, "attn_gate.rank=16 is not below 16, the rank of the full gate (16 "
                                                  "scores from 2048 input channels); use rank null for the full gate"),
    ],
)
def test_bad_specs_raise_naming_key_and_allowed_values(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GatedAttentionConfig(attn_gate=spec)


def test_attention_sinks_is_a_flag():
    with pytest.raises(ValueError, match="^attention_sinks='yes' is not allowed; allowed values: true, false$"):
        GatedAttentionConfig(attention_sinks="yes")


def test_non_dict_spec():
    with pytest.raises(ValueError, match="attn_gate must be a dict or null"):
        normalize_gate_spec("G1")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attn_output_norm", "layernorm", "attn_output_norm='layernorm' is not allowed; allowed values: null, 'rmsnorm'"),
        ("attn_output_activation", "gelu", "attn_output_activation='gelu' is not allowed; allowed values: null, 'silu'"),
    ],
)
def test_bad_output_ablations(field, value, message):
    with pytest.raises(ValueError, match=message):
        GatedAttentionConfig(**{field: value})


def test_spec_survives_json(tmp_path):
    config = GatedAttentionConfig(attn_gate={"position": "G2", "granularity": "headwise", "bias": True})
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["attn_gate"]
    assert stored == config.attn_gate
    assert GatedAttentionConfig.from_pretrained(tmp_path).attn_gate == config.attn_gate


# A config with HQ=8 query heads, HKV=2 key/value heads, D=16 and hidden 96 (not HQ * D, so a mix-up shows).
@pytest.mark.parametrize(
    "spec, shape",
    [
        ({"position": "G1"}, (8, 16)),
        ({"position": "G1", "granularity": "headwise"}, (8, 1)),
        ({"position": "G1", "head_shared": True}, (1, 16)),
        ({"position": "G4", "granularity": "headwise", "head_shared": True}, (1, 1)),
        ({"position": "G2"}, (2, 16)),
        ({"position": "G3", "granularity": "headwise"}, (2, 1)),
        ({"position": "G5"}, (96,)),
    ],
    ids=["G1", "G1-headwise", "G1-head-shared", "G4-headwise-shared", "G2", "G3-headwise", "G5"],
)
def test_gate_score_shape(spec, shape):
    spec = normalize_gate_spec(spec)
    assert gate_score_shape(spec, hidden_size=96, num_heads=8, num_key_value_heads=2, head_dim=16) == shape


def test_activation_tables_agree():
    """The spec's names, the torch functions and the fused kernels' codes name the same activations."""
    assert tuple(GATE_ACTIVATION_FUNCTIONS) == GATE_ACTIVATION_NAMES
    assert set(FUSED_GATE_ACTIVATIONS) <= set(GATE_ACTIVATION_NAMES)
    assert tuple(ACTIVATION_CODES) == FUSED_GATE_ACTIVATIONS
    assert sorted(ACTIVATION_CODES.values()) == list(range(len(ACTIVATION_CODES)))


def test_ns_sigmoid_by_hand():
    x = torch.tensor([float("-inf"), 0.0, float("inf")])
    assert GATE_ACTIVATION_FUNCTIONS["ns_sigmoid"](x).tolist() == [0.5, 0.75, 1.0]
