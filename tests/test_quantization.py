"""Quantized gated models: `analyze --quantization` and `quantize`, on tiny models against compressed-tensors.

Tolerances: where two paths run compressed-tensors' own rounding on the same numbers (the preset applied by
hand against `quantization.rounding`, the written checkpoint against the model it was written from), the
numbers are compared exactly; the rest are orderings (a planted outlier raises the error) that hold by far.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import re

import pytest
import torch

pytest.importorskip("compressed_tensors")

import gated_attention as ga  # noqa: E402
from gated_attention.cli import main  # noqa: E402
from gated_attention.quantization import measure, targets  # noqa: E402
from gated_attention.quantization.rounding import quantized_copy  # noqa: E402
from test_analysis_capture import FAMILIES, build, tiny_tokenizer  # noqa: E402

# Widths that every preset's groups tile (W4A16's 128, MXFP4's 32, NVFP4's 16).
WIDE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4", "MXFP4")


def _model(**gate) -> ga.GatedAttentionForCausalLM:
    torch.manual_seed(0)
    return ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**WIDE, **gate)).eval()


def _inputs(n: int = 3, length: int = 24) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, WIDE["vocab_size"], (1, length), generator=generator) for _ in range(n)]


def _rows(model, schemes) -> dict[tuple[str, str], dict]:
    return {(r["scheme"], r["arm"]): r for r in measure.measure(model, _inputs(), schemes)[1]}


def test_gates_at_their_exact_init_quantize_for_free_in_every_scheme():
    # `convert --init exact` leaves every gate weight 0: every format rounds 0 to 0, so the gates' scores stay
    # sigmoid(0) = 0.5 and rounding them costs nothing, whatever their input's rounding.
    model = _model()
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.self_attn.attn_gate.weight)
    rows = _rows(model, SCHEMES)
    for scheme in SCHEMES:
        assert rows[(scheme, "gates_only")]["kl"] == 0 and rows[(scheme, "gates_only")]["top1_agreement"] == 1
        assert rows[(scheme, "gates_kept")]["kl"] == rows[(scheme, "all")]["kl"]
        assert rows[(scheme, "all")]["kl"] > 0  # the rest of the model does round
        assert rows[(scheme, "gates_kept")]["weight_bytes"] > rows[(scheme, "all")]["weight_bytes"]


def test_nvfp4_gives_projections_an_engine_fuses_one_global_scale():
    # vLLM multiplies q/k/v as one qkv_proj and gate/up as one gate_up_proj, with one NVFP4 global scale each
    # (llm-compressor's oneshot shares it so): their group scales must be relative to the same one. The gate and
    # the output projection keep their own; a group not rounded whole (the arm gates_only) shares nothing.
    model = _model(attn_gate={"position": "G1"})
    layer = "model.layers.0"
    model.get_submodule(f"{layer}.self_attn.k_proj").weight.data *= 4  # the group's largest weight is k's
    plan = targets.arms(model)
    copy = quantized_copy(model, "NVFP4", plan["all"], _inputs(1))
    scale = {name: copy.get_submodule(f"{layer}.{name}").weight_global_scale.item()
             for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.attn_gate",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert scale["self_attn.q_proj"] == scale["self_attn.k_proj"] == scale["self_attn.v_proj"]
    assert scale["mlp.gate_proj"] == scale["mlp.up_proj"]
    assert len({scale["self_attn.q_proj"], scale["mlp.gate_proj"], scale["self_attn.attn_gate"], scale["self_attn.o_proj"]}) == 4
    alone = {"model.layers.0.self_attn.q_proj": None}
    own = quantized_copy(model, "NVFP4", alone, _inputs(1)).get_submodule(f"{layer}.self_attn.q_proj").weight_global_scale
    assert own.item() != scale["self_attn.q_proj"]


def test_a_planted_outlier_channel_raises_the_kurtosis_and_the_w8a8_error():
    # Scaling one value channel up and o_proj's column for it down by the same power of two changes no output,
    # and puts one channel 64 times the rest into o_proj's input: per-token INT8 then rounds the rest coarsely.
    model = _model()
    planted = _model()
    with torch.no_grad():
        for layer in planted.model.layers:
            attention = layer.self_attn
            attention.v_proj.weight[5] *= 64
            for head in range(WIDE["num_attention_heads"] // WIDE["num_key_value_heads"]):  # the heads KV head 0 serves
                attention.o_proj.weight[:, head * WIDE["head_dim"] + 5] /= 64
    inputs = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(planted(inputs[0]).logits, model(inputs[0]).logits, rtol=1e-4, atol=1e-5)

    def o_proj_kurtosis(m):
        return [r["kurtosis"] for r in measure.outliers(m, inputs) if r["kind"] == "attention_output"]

    assert min(o_proj_kurtosis(planted)) > 5 * max(o_proj_kurtosis(model))
    assert _rows(planted, ["W8A8"])[("W8A8", "all")]["kl"] > 5 * _rows(model, ["W8A8"])[("W8A8", "all")]["kl"]


def test_w4a16_equals_compressed_tensors_preset_applied_by_hand():
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model, inputs = _model(), _inputs(1)
    by_hand = _model()
    config = QuantizationConfig(config_groups={"g": preset_name_to_scheme("W4A16", ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(by_hand, config, show_progress=False)
    with torch.no_grad():
        for module in by_hand.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                groups = module.weight.unflatten(-1, (-1, 128))  # [out, in / 128, 128]
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), module.quantization_scheme.weights)
                module.weight_scale.copy_(scale)
                module.weight_zero_point.copy_(zero_point)
        expected = by_hand(inputs[0]).logits
        got = quantized_copy(model, "w4a16", targets.arms(model)["all"]).forward(inputs[0]).logits
    assert torch.equal(got, expected)


def test_a_gate_fused_into_q_proj_has_row_arms_that_split_the_tensor():
    model = build("qwen3_5_text")
    plan = targets.arms(model)
    assert set(plan) == {"all", "gates_kept", "gates_only", "gate_rows_only", "query_rows_only"}
    (path, rows), = list(plan["gate_rows_only"].items())[:1]
    assert path.endswith("self_attn.q_proj") and int(rows.sum()) == rows.numel() // 2
    assert torch.equal(plan["query_rows_only"][path], ~rows)
    assert all(p.endswith("self_attn.q_proj") for p in plan["gates_only"])
    # Kept, the fused q_proj keeps the k_proj and v_proj vLLM multiplies it with (it refuses them kept unlike)
    attention = path.removesuffix(".q_proj")
    assert not {f"{attention}.{name}" for name in ("q_proj", "k_proj", "v_proj")} & set(plan["gates_kept"])
    assert f"{attention}.o_proj" in plan["gates_kept"]
    # Rounding the gate rows leaves the query rows' outputs as they were, bit for bit.
    quantized = quantized_copy(model, "W8A8", plan["gate_rows_only"])
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        before, after = model.get_submodule(path)(x), quantized.get_submodule(path)(x)
    assert torch.equal(before[..., ~rows], after[..., ~rows]) and not torch.equal(before[..., rows], after[..., rows])


@pytest.mark.parametrize("family", [f for f, (_, _, kind) in FAMILIES.items() if kind in ("attn_gate", "q_proj")])
def test_the_ignore_list_matches_every_gate_module_and_nothing_else(family):
    # ... nothing else than what `quantize --gates keep` keeps: the gates, and beside a fused q_proj its k and v
    model = build(family)
    fused = FAMILIES[family][2] == "q_proj"
    patterns = [p.removeprefix("re:") for p in targets.ignore_lists(fused)["llm-compressor"] if p != "lm_head"]
    gates = set(targets.gate_rows(model))
    linears = set(targets.linear_paths(model))
    kept = linears - set(targets.arms(model)["gates_kept"])
    assert gates and gates <= kept and (kept == gates) != fused
    matched = {path for path in linears if any(re.fullmatch(p, path) for p in patterns)}
    assert matched == kept
    gptq = [p.removeprefix("-:") for p in targets.ignore_lists(fused)["gptqmodel"]]
    assert {path for path in linears if any(re.fullmatch(p, path) for p in gptq)} == kept
    modelopt = [p for p in targets.ignore_lists(fused)["modelopt"] if "lm_head" not in p]
    assert {path for path in linears if any(fnmatch.fnmatch(path, p) for p in modelopt)} == kept


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q") / "tiny"
    _model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


FLAGS = ("--max-length", "24", "--n-per-domain", "1")


def test_analyze_quantization_and_quantize_agree_and_the_checkpoint_loads(model_dir, tmp_path, capsys, monkeypatch,
                                                                          run_without_package):
    out = tmp_path / "analysis"
    assert main(["analyze", str(model_dir), "--out", str(out), "--quantization", "w8a8", "--bootstrap", "10", *FLAGS]) == 0
    with open(out / "quantization.csv", newline="") as f:
        rows = {(r["scheme"], r["arm"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("none", "none"), ("W8A8", "all"), ("W8A8", "gates_kept"), ("W8A8", "gates_only")}
    assert "keeping the gates in 16 bits" in (out / "summary.md").read_text()
    kinds = {r["kind"] for r in csv.DictReader(open(out / "quantization_layers.csv", newline=""))}
    assert kinds == {"attention_output", "mlp_down", "gate"}

    from test_hub_push import FakeHub

    hub = FakeHub().install(monkeypatch)
    dst = tmp_path / "w8a8"
    assert main(["quantize", str(model_dir), str(dst), "--scheme", "W8A8", "--gates", "quantize", *FLAGS,
                 "--push-to-hub", "me/w8a8"]) == 0
    assert [(name, repo) for name, repo, _ in hub.calls] == [("create_repo", "me/w8a8"), ("upload_folder", "me/w8a8")]
    assert "README.md" in hub.calls[1][2]["files"] and "gated-attention quantize" in hub.calls[1][2]["commit_message"]
    printed = capsys.readouterr().out
    assert "compressed-tensors alone" in printed
    kl = float(rows[("W8A8", "all")]["kl"])
    assert f"KL {kl:.3g} (measured {kl:.3g})" in printed  # the loaded checkpoint gives the analysis's figure
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(dst)
    assert loaded.model.layers[0].self_attn.attn_gate.weight.dtype == torch.int8
    card = (dst / "README.md").read_text()
    assert "base_model_relation: quantized" in card and "attn_gate" in card
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = loaded(ids).logits[0, -1].tolist()
    got = run_without_package(
        "import json, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True)\n"
        "print(json.dumps(m(torch.tensor([[5, 6, 7, 8]])).logits[0, -1].tolist()))\n")
    assert json.loads(got.strip().splitlines()[-1]) == expected

    # Without --gates, a model with gates keeps them (docs/quantization.md has the measurements behind it)
    assert main(["quantize", str(model_dir), str(tmp_path / "kept"), "--scheme", "W8A8", *FLAGS]) == 0
    printed = capsys.readouterr().out
    kl = float(rows[("W8A8", "gates_kept")]["kl"])
    assert "gates kept (arm gates_kept)" in printed and f"KL {kl:.3g} (measured {kl:.3g})" in printed
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "kept")
    assert kept.model.layers[0].self_attn.attn_gate.weight.dtype == torch.float32


@pytest.mark.parametrize("argv, message", [
    (["analyze", "{model}", "--out", "{tmp}/a", "--quantization", "W9A9"], "unknown quantization scheme 'W9A9'"),
    (["quantize", "{model}", "{tmp}/q", "--scheme", "int3"], "unknown quantization scheme 'int3'"),
    (["quantize", "{small}", "{tmp}/q", "--scheme", "W4A16"], "group size 128 does not divide model.layers.0.self_attn.q_proj's input width 32"),
    (["quantize", "{ungated}", "{tmp}/q", "--scheme", "W8A8", "--gates", "keep"], "has no gate of linear maps"),
    (["quantize", "{model}", "{model}", "--scheme", "W8A8"], "DST"),
])
def test_bad_input_is_one_line_and_writes_nothing(model_dir, tmp_path, capsys, argv, message):
    small, ungated = tmp_path / "small", tmp_path / "ungated"
    torch.manual_seed(0)
    ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**{**WIDE, "hidden_size": 32, "head_dim": 8})).save_pretrained(small)
    _model(attn_gate=None).save_pretrained(ungated)
    for folder in (small, ungated):
        tiny_tokenizer().save_pretrained(folder)
    capsys.readouterr()  # the progress bars of the saves above
    before = sorted(p.name for p in tmp_path.iterdir())
    names = {"model": model_dir, "tmp": tmp_path, "small": small, "ungated": ungated}
    assert main([a.format(**names) for a in argv] + list(FLAGS)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "it/s]" not in line]  # not the loading bar
    assert len(err) == 1 and message in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
