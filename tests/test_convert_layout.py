"""`convert --no-verify` of a dense model without the modeling code: the layout and remote code it writes
from the config alone are exactly what the model itself gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from convert_helpers import file_hashes, make_source
from gated_attention import GatedAttentionConfig
from gated_attention.convert.shapes import dense_shapes, expected_shapes
from gated_attention.hub.remote_code import write_remote_code, write_remote_code_for_config
from test_cli import imported_modules

BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# Every config field that adds, drops or reshapes a tensor.
VARIANTS = {
    "G1-elementwise": {},
    "G1-headwise-bias": {"attn_gate": {"position": "sdpa", "granularity": "headwise", "bias": True}},
    "ungated-tied": {"attn_gate": None, "tie_word_embeddings": True},
    "llama-attention-bias": {"attention_bias": True},
    "qwen2-qkv-bias": {"qkv_bias": True, "tie_word_embeddings": True},
    "qwen3-qk-norm-head-dim": {"qk_norm": True, "head_dim": 16},
    "mlp-bias": {"mlp_bias": True},
    "G2-value-head-shared": {"attn_gate": {"position": "value", "head_shared": True}},
    "G5-dense": {"attn_gate": {"position": "dense"}},
    "input-independent": {"attn_gate": {"position": "sdpa", "input_dependent": False}},
    "low-rank-input-channels-bias": {"attn_gate": {"rank": 4, "input_channels": 12, "bias": True}},
    "input-channels": {"attn_gate": {"input_channels": 12}},
    "sinks": {"attention_sinks": True},
    "output-norm": {"attn_output_norm": "rmsnorm", "attn_output_activation": "silu"},
    "sliding-window-gqa1": {"sliding_window": 4, "num_key_value_heads": 1},
}


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_shapes_are_the_models_own(variant):
    config = GatedAttentionConfig(**{**BASE, **VARIANTS[variant]})
    # Same names, same shapes, same order (the order decides which missing tensor an error names first).
    assert list(dense_shapes(config).items()) == list(expected_shapes(meta_model(config)).items())


@pytest.mark.parametrize("variant", ["G1-elementwise", "qwen3-qk-norm-head-dim"])
def test_remote_code_from_the_config_equals_the_models(tmp_path, variant):
    by_config = GatedAttentionConfig(**{**BASE, **VARIANTS[variant]})
    model = meta_model(GatedAttentionConfig(**{**BASE, **VARIANTS[variant]}))
    files_model = write_remote_code(tmp_path / "model", model)
    files_config = write_remote_code_for_config(tmp_path / "config", by_config)
    assert files_config == files_model
    assert file_hashes(tmp_path / "config") == file_hashes(tmp_path / "model")
    assert by_config.auto_map == model.config.auto_map
    assert by_config.architectures == [type(model).__name__]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_no_verify_conversion_imports_no_models_and_writes_the_same_checkpoint(tmp_path, family):
    src = make_source(family, tmp_path / "src")
    command = [sys.executable, "-m", "gated_attention", "convert", str(src)]
    verified = subprocess.run([*command, str(tmp_path / "verified")], capture_output=True, text=True, timeout=600)
    assert verified.returncode == 0, verified.stderr[-2000:]
    fast = subprocess.run([sys.executable, "-X", "importtime", *command[1:], str(tmp_path / "fast"), "--no-verify"],
                          capture_output=True, text=True, timeout=600)
    assert fast.returncode == 0, fast.stderr[-2000:]
    modules = imported_modules(fast.stderr)
    assert "gated_attention.convert.convert" in modules
    # (the bare `gated_attention.modeling` package is imported to find its files for the remote code: a docstring)
    loaded = sorted(m for m in modules if m.startswith(("gated_attention.modeling.", "transformers.modeling_utils")))
    assert not loaded, loaded
    assert file_hashes(tmp_path / "fast") == file_hashes(tmp_path / "verified")
