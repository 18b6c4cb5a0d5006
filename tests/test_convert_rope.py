"""RoPE base change and YaRN: the written rope_parameters give the intended frequencies in transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from convert_helpers import PROMPT, TINY, make_source
from gated_attention import GatedAttentionConfig
from gated_attention.cli import main

HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]  # 16


def yarn_by_hand(theta: float, dim: int, factor: float, original: int, beta_fast=32, beta_slow=1):
    """YaRN (Peng et al. 2023, eqs. 17-20), written from the paper: blend interpolated and original
    frequencies with a ramp over the dimensions whose wavelength lies between original/beta_fast and
    original/beta_slow rotations."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    inv_freq = 1.0 / theta ** (i / dim)

    def dim_for(rotations):  # the dimension index whose wavelength fits `rotations` times into `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_for(beta_fast)), 0), min(math.ceil(dim_for(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    blended = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    return blended, 0.1 * math.log(factor) + 1.0


def rotary(model):
    emb = model.model.rotary_emb
    return emb.inv_freq, emb.attention_scaling


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory):
    # Plain RoPE (no llama3 scaling), max_position_embeddings 128.
    return make_source("llama", tmp_path_factory.mktemp("rope") / "src", rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_convert_with_yarn_writes_the_yarn_frequencies(llama_source, tmp_path):
    dst = tmp_path / "yarn"
    args = ["--yarn-factor", "4", "--original-max-position-embeddings", "64", "--rope-theta", "5e4"]
    assert main(["convert", str(llama_source), str(dst), *args]) == 0  # verification: bit-identical to SRC with the same RoPE

    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"] == {
        "rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0, "original_max_position_embeddings": 64,
    }  # fmt: skip
    assert config["max_position_embeddings"] == 256  # factor x original

    inv_freq, attention_factor = rotary(AutoModelForCausalLM.from_pretrained(dst))
    expected, expected_factor = yarn_by_hand(5e4, HEAD_DIM, 4.0, 64)
    # fp32 (transformers) against fp64 (by hand): the same formula, rounding only.
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-12)
    # transformers' own function on a config built from the intended parameters agrees too.
    intended = GatedAttentionConfig(**{**TINY, "max_position_embeddings": 256}, rope_parameters=dict(config["rope_parameters"]))
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](intended)
    assert torch.equal(inv_freq, ref_freq) and attention_factor == ref_factor

    # The trap the required option closes: with the original length left to default to
    # max_position_embeddings (256), YaRN's ramp lands elsewhere.
    wrong, _ = yarn_by_hand(5e4, HEAD_DIM, 4.0, 256)
    assert not torch.allclose(inv_freq.double(), wrong, rtol=1e-3)


def test_rope_theta_change(llama_source, tmp_path):
    assert main(["convert", str(llama_source), str(tmp_path / "theta"), "--rope-theta", "1e6", "--no-verify"]) == 0
    inv_freq, attention_factor = rotary(AutoModelForCausalLM.from_pretrained(tmp_path / "theta"))
    expected = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert attention_factor == 1.0


def test_extend_a_gated_checkpoint(llama_source, tmp_path, capsys):
    gated = tmp_path / "gated"
    assert main(["convert", str(llama_source), str(gated), "--no-verify"]) == 0
    dst = tmp_path / "extended"
    args = ["--yarn-factor", "2", "--original-max-position-embeddings", "128"]
    assert main(["extend", str(gated), str(dst), *args]) == 0
    assert "bit-identical" in capsys.readouterr().out  # SRC loaded with the new RoPE vs the result

    before = AutoModelForCausalLM.from_pretrained(gated)
    after = AutoModelForCausalLM.from_pretrained(dst)
    for (name, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items()):
        assert torch.equal(a, b), name  # weights are copied unchanged
    inv_freq, attention_factor = rotary(after)
    expected, expected_factor = yarn_by_hand(1e4, HEAD_DIM, 2.0, 128)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-12)
    assert after.config.max_position_embeddings == 256
    assert "## What changed" in (dst / "README.md").read_text()
    with torch.no_grad():  # short prompts sit in YaRN's unscaled band only partly: the logits do change
        assert not torch.equal(before.eval()(PROMPT).logits, after.eval()(PROMPT).logits)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--yarn-factor", "4", "--original-max-position-embeddings", "512"], "larger than SRC's max_position_embeddings"),
        (["--yarn-factor", "0.5", "--original-max-position-embeddings", "64"], "--yarn-factor must be a number > 1"),
        (["--original-max-position-embeddings", "64"], "only used with --yarn-factor"),
    ],
    ids=["original-too-long", "factor-below-one", "original-alone"],
)
def test_bad_rope_options(llama_source, tmp_path, capsys, args, message):
    assert main(["convert", str(llama_source), str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_extend_refuses_a_plain_checkpoint(llama_source, tmp_path, capsys):
    assert main(["extend", str(llama_source), str(tmp_path / "out"), "--rope-theta", "1e6"]) == 2
    assert "use `gated-attention convert`" in capsys.readouterr().err
