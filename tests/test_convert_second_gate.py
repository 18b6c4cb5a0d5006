"""A source that gates its attention output already is refused by `convert` in one line: no second gate on top.

Qwen3-Next and Qwen3.5 gate with the second half of each head's `q_proj` rows, which `analyze` reads as their gate
site (`modeling/gate_sites.py`); a config.json may also say so itself (`attn_output_gate`, as vLLM reads it). The
other gated types transformers ships, built as the catalog builds them, are refused too: a gate `analyze` reads
(`OUTPUT_GATES`, a fused `q_gate_proj`) or one it does not (`UNREAD_OUTPUT_GATES`: Dory's scaled, Beam's biased).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from gated_attention.cli import main

from convert_helpers import file_hashes, staging_leftovers
from test_analyze_architectures import catalog, shipped

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
SOURCES = {
    "qwen3_next": dict(moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1, shared_expert_intermediate_size=16),
    "qwen3_5_text": {},
}


def refused(src, dst, capsys) -> str:
    before = file_hashes(src)
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and staging_leftovers(dst) == []
    assert file_hashes(src) == before
    return err


@pytest.mark.parametrize("model_type", SOURCES)
def test_a_source_with_its_own_gate_is_refused(model_type, tmp_path, capsys):
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {model_type}")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES, **SOURCES[model_type])).save_pretrained(
        tmp_path / "src")
    err = refused(tmp_path / "src", tmp_path / "dst", capsys)
    assert "gates its attention output already" in err and "the second half of each head's q_proj rows" in err, err
    assert "`gated-attention analyze` reads that gate's scores" in err and "`export` and serving" in err, err


def test_a_config_flag_saying_so_is_refused_before_any_model_is_built(tmp_path, capsys):
    if "qwen3_5_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no qwen3_5_text")
    src = tmp_path / "src"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **SIZES)).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "attn_output_gate": True}))
    assert "(config.json sets attn_output_gate: true)" in refused(src, tmp_path / "dst", capsys)


# model type -> the words its refusal names the gate by
CATALOG_GATED = {
    "afmoe": "AfmoeAttention's sigmoid output gate gate_proj",
    "hrm_text": "HrmTextAttention's sigmoid output gate gate_proj",
    "minicpm5_moe": "the second half of each head's q_gate_proj rows",
    "qwen4_exp": "the second half of each head's q_proj rows",
    "bailing_hybrid": "BailingHybridAttention's sigmoid output gate g_proj",
    "beam": "BeamAttention's output gate gate_proj, sigmoid(gate_proj(x) + a bias per head",
    "dory": "DoryAttention's output gate gate_proj, sigmoid(gate_proj(x) * (s_gate * s_gate_scale)^2)",
    "axk2": "AXK2Attention's output gate q_gate_proj",
}
UNREAD = {"beam", "dory", "axk2"}


@pytest.mark.parametrize("model_type", CATALOG_GATED)
def test_every_gated_type_transformers_ships_is_refused(model_type, tmp_path, capsys):
    shipped(model_type)
    catalog().build(model_type).save_pretrained(tmp_path / "src")
    err = refused(tmp_path / "src", tmp_path / "dst", capsys)
    assert "gates its attention output already" in err and CATALOG_GATED[model_type] in err, err
    read = "reads the model, though not that gate's scores" if model_type in UNREAD else "reads that gate's scores"
    assert f"`gated-attention analyze` {read}" in err, err
