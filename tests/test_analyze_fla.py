"""`analyze` on flash-linear-attention's (fla) own checkpoints, on the CPU: the hybrid paper's M-A-P suite.

Each family of the suite (GLA, RetNet, HGRN, HGRN2, DeltaNet, Gated DeltaNet, KDA), pure and as a hybrid with
fla's softmax attention at layers 2 and 4, is saved by fla's own `save_pretrained` and analysed through the
command line: fla's model types load, every mixer runs on its torch path (`fla_cpu.fla_torch_paths`), and the
attention layers' maps are captured. References: the attention weights fla's layer returns on that path
(themselves checked against a computation by hand from the layer's weights in tests/test_fla_torch_paths.py),
read here through a raw `Capture` on the same input; and, for the Gated DeltaNet hybrid, the same model
converted into this package's hybrid, whose analysis must agree layer by layer.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed")

from fla import models as fla_models  # noqa: E402

from gated_attention.analysis.capture import Capture  # noqa: E402
from gated_attention.analysis.samples import builtin_samples  # noqa: E402
from gated_attention.cli import main  # noqa: E402
from gated_attention.fla_cpu import fla_torch_paths  # noqa: E402
from test_analysis_capture import tiny_tokenizer  # noqa: E402

VOCAB = 300
FAMILIES = {  # family: (config class, model class, config fields)
    "gla": ("GLAConfig", "GLAForCausalLM", {"num_heads": 2}),
    "retnet": ("RetNetConfig", "RetNetForCausalLM", {"num_heads": 2}),
    "hgrn": ("HGRNConfig", "HGRNForCausalLM", {}),
    "hgrn2": ("HGRN2Config", "HGRN2ForCausalLM", {"num_heads": 2, "expand_ratio": 16}),
    "delta_net": ("DeltaNetConfig", "DeltaNetForCausalLM", {"num_heads": 2}),
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", {"num_heads": 2, "head_dim": 16}),
    "kda": ("KDAConfig", "KDAForCausalLM", {"num_heads": 2, "head_dim": 16}),
}
HYBRID = {"layers": [1, 3], "num_heads": 4}  # fla's full-attention layers, 0-based
CASES = [(family, attn) for family in FAMILIES for attn in (None, HYBRID)]
IDS = [f"{family}-{'hybrid' if attn else 'pure'}" for family, attn in CASES]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def save_fla_model(folder, family: str, attn, tokenizer, **fields):
    config_class, model_class, own = FAMILIES[family]
    config = getattr(fla_models, config_class)(
        hidden_size=64, num_hidden_layers=4, vocab_size=VOCAB, intermediate_size=96, attn=attn,
        bos_token_id=tokenizer.bos_token_id, **{**own, **fields},
    )  # fmt: skip
    torch.manual_seed(0)
    with fla_torch_paths():  # fla's attention layer cannot be built without flash-attn otherwise
        model = getattr(fla_models, model_class)(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def analyze(folder, out) -> int:
    return main(["analyze", str(folder), "--out", str(out), "--n-per-domain", "1", "--max-length", "24", "--bootstrap", "10"])


@pytest.mark.parametrize("family, attn", CASES, ids=IDS)
def test_every_fla_family_is_analysed_on_the_cpu(family, attn, tokenizer, tmp_path):
    model = save_fla_model(tmp_path / "model", family, attn, tokenizer)
    assert analyze(tmp_path / "model", tmp_path / "out") == 0
    layers = _csv(tmp_path / "out" / "layers.csv")
    attention = [int(r["layer"]) for r in layers if r["is_attention"] == "True"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    if attn is None:
        assert attention == [] and "the model has no softmax attention" in summary
        return
    assert attention == [2, 4]
    assert [r["layer_type"] for r in layers[1:]] == [type(model.model.layers[0]).__name__, "full_attention"] * 2
    # F-Attn per layer is the mean attention on token 0 in the maps fla's layer returns for the same inputs.
    inputs = [tokenizer(s.text, truncation=True, max_length=24, return_tensors="pt")["input_ids"] for s in builtin_samples(1)]
    with torch.no_grad(), Capture(model) as cap:
        for ids in inputs:
            model(input_ids=ids, use_cache=False)
    for f in (2, 4):
        reference = np.mean([record.attentions[f][0, :, 1:, 0].double().mean().item() for record in cap.records])
        assert float(layers[f]["f_attn"]) == pytest.approx(reference, rel=0, abs=1e-9), f"layer {f}"


def test_an_fla_hybrid_and_its_conversion_give_the_same_analysis(tokenizer, tmp_path):
    """One model, two forms: fla's Gated DeltaNet hybrid, and the same weights converted into this package's hybrid
    (`convert --init exact`, logits bit-identical at conversion). The two run different code (fla's layers on their
    torch paths, ours on the package's), so the per-layer numbers agree to rounding: within 1e-5."""
    attn = {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": 5, "rope_theta": 10000.0}
    save_fla_model(tmp_path / "fla", "gated_deltanet", attn, tokenizer, num_v_heads=4, expand_v=1.5, use_gate=True)
    assert main(["convert", str(tmp_path / "fla"), str(tmp_path / "gated")]) == 0
    assert analyze(tmp_path / "fla", tmp_path / "out-fla") == 0
    assert analyze(tmp_path / "gated", tmp_path / "out-gated") == 0
    fla_layers, gated_layers = _csv(tmp_path / "out-fla" / "layers.csv"), _csv(tmp_path / "out-gated" / "layers.csv")
    assert [r["is_attention"] for r in fla_layers] == [r["is_attention"] for r in gated_layers]
    for a, b in zip(fla_layers, gated_layers):
        assert float(a["m_act"]) == pytest.approx(float(b["m_act"]), rel=1e-5, abs=1e-5), f"layer {a['layer']} M-Act"
        if a["f_attn"]:
            assert float(a["f_attn"]) == pytest.approx(float(b["f_attn"]), abs=1e-5), f"layer {a['layer']} F-Attn"


def test_within_a_memory_budget_the_arrays_are_the_same(tokenizer, tmp_path, capsys, weights_only_budget):
    """Every layer read from the checkpoint as it runs (a budget below the model): the same arrays, exactly.
    fla's fused SwiGLU (`fuse_swiglu`, its default) hands `down_proj.weight` to its kernel without calling
    `down_proj`, HGRN2's `rms_norm_linear` `o_proj.weight`: read module by module, as accelerate hooks an
    offloaded layer, those weights were never read (M-Act 9e36 where 0.07 was expected)."""
    save_fla_model(tmp_path / "model", "gated_deltanet", HYBRID, tokenizer)
    assert analyze(tmp_path / "model", tmp_path / "whole") == 0
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "model"), "--out", str(tmp_path / "budget"), "--n-per-domain", "1",
                 "--max-length", "24", "--bootstrap", "10", "--max-memory", "200KB"]) == 0
    assert "of weights read from the checkpoint as it runs" in capsys.readouterr().out
    with np.load(tmp_path / "whole" / "arrays.npz") as whole, np.load(tmp_path / "budget" / "arrays.npz") as budget:
        assert whole.files == budget.files
        for key in whole.files:
            np.testing.assert_array_equal(whole[key], budget[key], err_msg=key)

