"""`convert` of a quantized source: transformers' block FP8 and compressed-tensors' FP8 / INT8 / W4A16 weights, each
dequantized as it is read. The result must be, bit for bit in float32, the conversion of the source's dequantized
twin: the model transformers loads from the quantized folder with `dequantize=True` (its own FP8 block layout,
compressed-tensors' own decompression), saved as a plain checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gated_attention.cli import main

from convert_helpers import file_hashes, staging_leftovers

# hidden 128: compressed-tensors' W4A16 packs groups of 128 input channels
CONFIG = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32)  # fmt: skip
BLOCK = (32, 64)  # FP8 blocks [rows, columns]; DeepSeek-V3 and Qwen3 FP8 use [128, 128]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain_olmo2(tmp_path_factory):
    """A type no family reads: converted by declaration, in its own class."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    folder = tmp_path_factory.mktemp("plain_olmo2")
    torch.manual_seed(0)
    Olmo2ForCausalLM(Olmo2Config(**CONFIG)).save_pretrained(folder)
    return folder


def block_fp8(plain, folder, block=BLOCK):
    """`plain` with every projection's weight as float8 e4m3 blocks and `weight_scale_inv`, by hand."""
    tensors = {}
    for name, w in load_file(plain / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        grid = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
        scale = w.reshape(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3)) / 448  # e4m3's largest
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        tensors[name], tensors[f"{name}_scale_inv"] = (w / full).to(torch.float8_e4m3fn), scale
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def compressed(plain, folder, scheme):
    """`plain` rounded to compressed-tensors' preset `scheme` and saved compressed by its `ModelCompressor`."""
    from compressed_tensors.compressors import ModelCompressor

    from gated_attention.quantization.rounding import quantize_in_place
    from gated_attention.quantization.targets import linear_paths

    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    ids = [torch.randint(0, CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))]
    quantize_in_place(model, scheme, [p for p in linear_paths(model) if p != "lm_head"], ids)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder


def twin(quantized, folder):
    """The dequantized twin: transformers' own dequantizing load of `quantized`, saved as a plain float32 Llama."""
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    method = json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"]
    load = (FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK) if method == "fp8"
            else CompressedTensorsConfig(dequantize=True))  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32, quantization_config=load)
    model = type(loaded)(loaded.config)  # the config dequantize=True leaves: no quantization_config
    model.load_state_dict({k: v for k, v in loaded.state_dict().items() if k in model.state_dict()}, strict=True)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("scheme", ["block_fp8", "FP8_DYNAMIC", "W8A8", "W4A16", "olmo2_W8A8"])
def test_a_quantized_source_converts_as_its_dequantized_twin(plain, plain_olmo2, scheme, tmp_path, capsys):
    if scheme.startswith("olmo2_"):
        pytest.importorskip("compressed_tensors")
        src = compressed(plain_olmo2, tmp_path / "src", scheme.removeprefix("olmo2_"))
    elif scheme == "block_fp8":
        src = block_fp8(plain, tmp_path / "src")
    else:
        pytest.importorskip("compressed_tensors")
        src = compressed(plain, tmp_path / "src", scheme)
    twin(src, tmp_path / "twin")
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 0  # verified against transformers' dequantizing load
    assert "bit-identical" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "twin"), str(tmp_path / "twin_dst"), "--no-verify"]) == 0
    got, want = load_file(tmp_path / "dst" / "model.safetensors"), load_file(tmp_path / "twin_dst" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "- Source: quantized, " in card and "dequantized as it was read exactly" in card


def refused(src, dst, capsys) -> str:
    before = file_hashes(src)
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not dst.exists() and staging_leftovers(dst) == []
    assert file_hashes(src) == before
    return err


@pytest.mark.parametrize("broken, expected", [
    ("missing", "has no scale model.layers.0.self_attn.o_proj.weight_scale_inv"),
    ("misshaped", "has shape [4, 2]; weight [128, 128] in blocks of [32, 64] needs [4, 2]"),
    ("awq", "quant_method 'awq', which convert cannot read"),
])  # fmt: skip
def test_what_cannot_be_read_is_refused_in_one_line(plain, broken, expected, tmp_path, capsys):
    src = block_fp8(plain, tmp_path / "src")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    if broken == "awq":
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
        (src / "config.json").write_text(json.dumps(config))
    else:
        tensors = load_file(src / "model.safetensors")
        if broken == "missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name].t().contiguous()  # [4, 2] -> [2, 4]
            expected = "has shape [2, 4]; weight [128, 128] in blocks of [32, 64] needs [4, 2]"
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert expected in refused(src, tmp_path / "dst", capsys)
