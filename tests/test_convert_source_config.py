"""The converter reads SRC's config.json without transformers' per-family classes (they cost seconds
to import); what it reads must be what those classes read. Every case maps a config.json twice,
through `SourceConfig` and through `AutoConfig.from_pretrained` (the installed transformers' own class),
and the two gated configs must be equal field for field. tests/floor.sh runs this on the floor release.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from gated_attention.convert.convert import conversion_gate_spec
from gated_attention.convert.families import SOURCE_DEFAULTS, detect_family
from gated_attention.convert.source_config import SourceConfig
from gated_attention.convert.targets import target_config
from gated_attention.convert.sources import ConversionError

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

CASES = {
    # Only the model type: every field the mapping reads comes from the class's defaults.
    **{f"{model_type}-defaults": {"model_type": model_type} for model_type in SOURCE_DEFAULTS},
    "llama-small-gqa-tied-bf16": dict(SMALL, model_type="llama", tie_word_embeddings=True,
                                      torch_dtype="bfloat16", bos_token_id=0, eos_token_id=[1, 2], rms_norm_eps=1e-5),
    "llama-bias-headdim": dict(SMALL, model_type="llama", attention_bias=True, mlp_bias=True, head_dim=32),
    "llama-legacy-linear-rope": dict(SMALL, model_type="llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama-legacy-dynamic-rope": dict(SMALL, model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "llama-legacy-llama3-rope": dict(
        SMALL, model_type="llama", max_position_embeddings=256, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "llama-yarn-rope-parameters": dict(
        SMALL, model_type="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    ),
    "llama-rope-theta-only": dict(SMALL, model_type="llama", rope_theta=123456.0, dtype="float16"),
    "mistral-no-window": dict(SMALL, model_type="mistral", sliding_window=None, num_key_value_heads=1),
    "mistral-window": dict(SMALL, model_type="mistral", sliding_window=16, rope_theta=1e6),
    "qwen2-window-flag-off": dict(SMALL, model_type="qwen2", sliding_window=16, use_sliding_window=False),
    "qwen2-window-from-layer-2": dict(SMALL, model_type="qwen2", sliding_window=16, use_sliding_window=True,
                                      max_window_layers=2, rope_theta=1e6, tie_word_embeddings=True),
    "qwen2-layer-types-given": dict(SMALL, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                                    layer_types=["full_attention", "sliding_attention"] * 2),
    "qwen3-small": dict(SMALL, model_type="qwen3", head_dim=32, rope_theta=1e6),
    "qwen3-yarn-legacy": dict(SMALL, model_type="qwen3", rope_scaling={"type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 32}),
    "qwen3_moe-small": dict(SMALL, **MOE, model_type="qwen3_moe", num_experts=4, head_dim=32, norm_topk_prob=True,
                            decoder_sparse_step=2, mlp_only_layers=[0], router_aux_loss_coef=0.01),
    "qwen3_moe-local-experts-key": dict(SMALL, **MOE, model_type="qwen3_moe", num_local_experts=6),
    "mixtral-small": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=1e4,
                          output_router_logits=True),
    "mixtral-num-experts-key": dict(SMALL, model_type="mixtral", num_experts=3, sliding_window=32),
    "phi3-window-rope-theta": dict(SMALL, model_type="phi3", sliding_window=16, rope_theta=1e6, pad_token_id=0),
    # Legacy "su" rope_scaling, Phi-3's longrope.
    "phi3-legacy-su-rope": dict(
        SMALL, model_type="phi3", max_position_embeddings=256,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0 + i / 8 for i in range(8)],
                      "original_max_position_embeddings": 32},
    ),
}  # fmt: skip


def mapped(src, family) -> dict:
    config = target_config(src, family, conversion_gate_spec("elementwise", "exact")).to_dict()
    config.pop("transformers_version", None)
    return config


@pytest.mark.parametrize("case", CASES)
def test_source_config_reads_like_transformers_own_class(case, tmp_path):
    raw = CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    family = detect_family(raw)
    theirs = AutoConfig.from_pretrained(tmp_path)
    ours = SourceConfig(raw, family)
    assert mapped(ours, family) == mapped(theirs, family)
    assert ours.dtype == theirs.dtype
    assert raw == CASES[case]  # read, not edited


class Recorder:
    """Passes attribute reads through to a config and remembers their names."""

    def __init__(self, config):
        self.__dict__.update(config=config, seen=set())

    def __getattr__(self, name):
        self.seen.add(name)
        return getattr(self.config, name)


@pytest.mark.parametrize("model_type", SOURCE_DEFAULTS)
def test_every_field_the_mapping_reads_has_the_class_default(model_type):
    """The defaults-only cases above compare results; this names the field when a default goes
    missing or differs: every field of transformers' class that the mapping reads is in
    SOURCE_DEFAULTS with the class's default (model type, RoPE and dtype are handled apart)."""
    theirs = Recorder(AutoConfig.for_model(model_type))
    target_config(theirs, detect_family({"model_type": model_type}), conversion_gate_spec("elementwise", "exact"))
    fields = type(theirs.config).__dataclass_fields__
    read = {name for name in theirs.seen if name in fields} - {"model_type", "rope_parameters", "dtype"}
    assert read, theirs.seen
    for name in sorted(read):
        assert name in SOURCE_DEFAULTS[model_type], name
        assert SOURCE_DEFAULTS[model_type][name] == fields[name].default, name


def test_a_config_that_describes_no_model_is_one_line(tmp_path):
    from gated_attention.convert.source_config import load_source_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 0}))
    with pytest.raises(ConversionError, match="num_attention_heads = 0: expected at least 1"):  # the field named
        load_source_config(tmp_path, detect_family({"model_type": "llama"}))


def _members(annotation) -> set:
    """The types a union (or a single type) admits; a TypedDict admits dicts."""
    import types
    import typing

    members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    return {dict if typing.is_typeddict(t) else t for t in members}


@pytest.mark.parametrize("model_type", SOURCE_DEFAULTS)
def test_source_types_are_the_types_transformers_declares(model_type):
    """SOURCE_TYPES refuses what the family's class refuses, no more: for every field both know, the
    class's type admits nothing SOURCE_TYPES does not, and SOURCE_TYPES admits only None besides."""
    from gated_attention.convert.source_config import SOURCE_TYPES

    annotations = {}
    for klass in reversed(type(AutoConfig.for_model(model_type)).__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    known = [name for name in SOURCE_TYPES if name in annotations]
    assert set(SOURCE_DEFAULTS[model_type]) - {"head_dim"} <= set(known)  # Qwen2 and Qwen3-MoE derive head_dim
    for name in known:
        ours, theirs = _members(SOURCE_TYPES[name]), _members(annotations[name])
        assert theirs <= ours and ours - theirs <= {type(None)}, (name, ours, theirs)


def test_fla_types_are_the_annotations_of_flas_config():
    import inspect
    import typing

    fla_config = pytest.importorskip("fla.models.gated_deltanet.configuration_gated_deltanet").GatedDeltaNetConfig
    from gated_attention.convert.families import FLA_GDN_DEFAULTS
    from gated_attention.convert.source_config import FLA_GDN_TYPES

    parameters = inspect.signature(fla_config.__init__).parameters
    assert set(FLA_GDN_TYPES) == set(FLA_GDN_DEFAULTS)
    for name, ours in FLA_GDN_TYPES.items():
        theirs = _members(parameters[name].annotation)
        if name == "attn":  # one spec (fla's TypedDict) or, in newer fla, a list of them, which no converter reads
            theirs = {dict if t is not type(None) else t for t in theirs if typing.get_origin(t) is not list}
        assert theirs <= _members(ours), (name, ours, theirs)
        assert parameters[name].default == FLA_GDN_DEFAULTS[name], name
