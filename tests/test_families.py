"""What every model family shares with transformers' own models: class layout, the window flag."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast

from gated_attention import (
    GatedAttentionConfig,
    GatedAttentionForCausalLM,
    GatedAttentionModel,
    GatedAttentionMoeConfig,
    GatedAttentionMoeForCausalLM,
    GatedAttentionMoeModel,
    GatedDeltaNetHybridConfig,
    GatedDeltaNetHybridForCausalLM,
    GatedDeltaNetHybridModel,
)
from gated_attention.modeling.gated_attention_moe import GatedAttentionMoeCausalLMOutput

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
FAMILIES = {
    "dense": (GatedAttentionConfig, GatedAttentionModel, GatedAttentionForCausalLM, {}),
    "moe": (
        GatedAttentionMoeConfig,
        GatedAttentionMoeModel,
        GatedAttentionMoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "hybrid": (
        GatedDeltaNetHybridConfig,
        GatedDeltaNetHybridModel,
        GatedDeltaNetHybridForCausalLM,
        dict(hybrid_ratio=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=12),
    ),
}
# Packed and one-by-one runs do the same fp32 arithmetic in differently shaped calls (SDPA with a packed mask
# against SDPA with is_causal, delta-rule chunks padded differently), which leaves ~1e-7 on logits of size ~1.
# A sequence that sees the one before it is off by ~1e-2 (0.0195 for the hybrid's GDN layers before the fix).
ATOL = 1e-5
# 70 is more than one delta-rule chunk (64), 2 is shorter than the GDN's convolution (4 taps).
LENGTHS = [5, 70, 2, 9]


def tiny_config(family: str, **overrides):
    config_cls, _, _, extra = FAMILIES[family]
    return config_cls(**{**TINY, **extra, **overrides})


def tiny_model(family: str, **overrides):
    model = FAMILIES[family][2](tiny_config(family, **overrides)).eval()
    with torch.no_grad():  # unit norms would let a mixed-up sequence hide behind symmetric weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def sequences(lengths=LENGTHS) -> list[torch.Tensor]:
    return [torch.randint(3, TINY["vocab_size"], (n,)) for n in lengths]


def one_by_one(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """`[sum(lengths), vocab]`: each sequence's logits from a forward of its own."""
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in seqs])


# --- the classes, as transformers lays its models out ------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_lists_generation_mixin_among_its_bases(family):
    assert GenerationMixin in FAMILIES[family][2].__bases__


EXPECTED_OUTPUTS = {
    GatedAttentionModel: BaseModelOutputWithPast,
    GatedAttentionForCausalLM: CausalLMOutputWithPast,
    GatedAttentionMoeModel: MoeModelOutputWithPast,
    GatedAttentionMoeForCausalLM: GatedAttentionMoeCausalLMOutput,
    GatedDeltaNetHybridModel: MoeModelOutputWithPast,
    GatedDeltaNetHybridForCausalLM: GatedAttentionMoeCausalLMOutput,
}


@pytest.mark.parametrize("model_cls", EXPECTED_OUTPUTS, ids=lambda c: c.__name__)
def test_forward_is_annotated_with_the_class_it_returns(model_cls):
    """The raw annotation, as tools read it (not a string), names the output class the forward really returns."""
    annotation = model_cls.forward.__annotations__["return"]
    assert annotation is EXPECTED_OUTPUTS[model_cls]
    family = next(name for name, (_, base, lm, _) in FAMILIES.items() if model_cls in (base, lm))
    model = model_cls(tiny_config(family)).eval()
    with torch.no_grad():
        assert type(model(torch.randint(3, TINY["vocab_size"], (1, 4)))) is annotation
    if family != "dense":
        assert "router_logits" in annotation.__dataclass_fields__


# --- use_sliding_window, as in Qwen2 / Qwen3 ---------------------------------------------------------


@pytest.mark.parametrize(
    "given, window, flag",
    [
        ({}, None, False),
        ({"sliding_window": 8}, 8, True),
        ({"sliding_window": 8, "use_sliding_window": True}, 8, True),
        ({"sliding_window": 8, "use_sliding_window": False}, None, False),  # Qwen2: a size kept with the flag off
    ],
    ids=["no-window", "window", "window-and-flag", "flag-off"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_use_sliding_window_agrees_with_sliding_window(family, given, window, flag):
    config = tiny_config(family, **given)
    assert (config.sliding_window, config.use_sliding_window) == (window, flag)
    if family != "hybrid":  # the hybrid's schedule has no sliding layers unless layer_types names them
        assert ("sliding_attention" in config.layer_types) is flag


@pytest.mark.parametrize("family", FAMILIES)
def test_use_sliding_window_without_a_window_is_refused(family):
    with pytest.raises(ValueError, match="use_sliding_window"):
        tiny_config(family, use_sliding_window=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_saved_before_the_flag_keep_their_window(family, tmp_path):
    tiny_config(family, sliding_window=8).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_sliding_window"] is True
    del saved["use_sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    again = FAMILIES[family][0].from_pretrained(tmp_path)
    assert (again.sliding_window, again.use_sliding_window) == (8, True)
