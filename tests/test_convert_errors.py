"""Bad input to `gated-attention convert`: one line on stderr, a non-zero exit, no DST, SRC untouched."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from convert_helpers import PROMPT, big_source, file_hashes, make_source, staging_leftovers
from gated_attention.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_source(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("base") / "src")


@pytest.fixture
def src(base_source, tmp_path):
    return Path(shutil.copytree(base_source, tmp_path / "src"))


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def refuse(argv, capsys, dst: Path, src: Path | None, expected: str) -> str:
    """Run the CLI; it must fail with one line on stderr naming the problem, leaving no DST and SRC as it was."""
    before = file_hashes(src) if src is not None and src.is_dir() else None
    capsys.readouterr()  # drop what the test itself printed
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"gated-attention {argv[0]}: error: ")
    assert expected in err, err
    assert not dst.exists() or dst.name in ("existing", "empty")
    assert staging_leftovers(dst) == []
    if before is not None:
        assert file_hashes(src) == before
    return err


def test_missing_path(tmp_path, capsys):
    refuse(["convert", str(tmp_path / "nope"), str(tmp_path / "out")], capsys, tmp_path / "out", None, "no such folder")


def test_no_config(src, tmp_path, capsys):
    (src / "config.json").unlink()
    refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, "has no config.json")


def test_unsupported_architecture_lists_the_supported_ones(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="no_such_model", architectures=["NoSuchModelForCausalLM"])  # not one transformers ships
    (src / "config.json").write_text(json.dumps(config))
    err = refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, "unsupported architecture")
    for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "by declaration"):
        assert name in err


def test_phi3_partial_rotary_is_refused_naming_the_field(tmp_path, capsys):
    """Phi-3 can rotate only part of each head; the dense model's RoPE rotates all of it, so that is refused."""
    src = make_source("phi3", tmp_path / "src", partial_rotary_factor=0.5)
    refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src,
           "SRC's Phi-3 config is not supported: partial_rotary_factor=0.5")  # fmt: skip


def test_truncated_shard(src, tmp_path, capsys):
    last = shards(src)[-1]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) - 100])
    refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, "is truncated")


def test_corrupted_header(src, tmp_path, capsys):
    first = shards(src)[0]
    data = bytearray(first.read_bytes())
    data[8:24] = b"\x00garbage-bytes!!"
    first.write_bytes(bytes(data))
    refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, "is corrupted")


def test_missing_shard(src, tmp_path, capsys):
    gone = shards(src)[1]
    gone.unlink()
    refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, f"missing shard {gone.name}")


def test_shapes_that_contradict_the_config(src, tmp_path, capsys):
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 100
    (src / "config.json").write_text(json.dumps(config))
    refuse(
        ["convert", str(src), str(tmp_path / "out")],
        capsys,
        tmp_path / "out",
        src,
        "in SRC but its config implies [",
    )


def test_existing_dst_needs_overwrite(src, tmp_path, capsys):
    dst = tmp_path / "existing"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse(["convert", str(src), str(empty)], capsys, empty, src, "already exists; pass --overwrite")
    # not --overwrite's to replace either: said at once rather than after the user adds --overwrite
    refuse(["convert", str(src), str(dst)], capsys, dst, src, "holds 'keep.txt' and is not a model checkpoint")
    assert (dst / "keep.txt").read_text() == "old"

    # --overwrite replaces a checkpoint only: a folder of the user's files is refused, naming one
    refuse(["convert", str(src), str(dst), "--overwrite"], capsys, dst, src, "holds 'keep.txt' and is not a model checkpoint")
    assert (dst / "keep.txt").read_text() == "old"

    (dst / "keep.txt").unlink()
    (dst / "config.json").write_text('{"model_type": "llama"}')
    assert main(["convert", str(src), str(dst), "--overwrite", "--no-verify"]) == 0
    assert json.loads((dst / "config.json").read_text())["model_type"] == "gated_attention"
    assert staging_leftovers(dst) == []


def test_pickle_only_needs_allow_pickle(base_source, tmp_path, capsys):
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(base_source / "config.json", src)
    model = AutoModelForCausalLM.from_pretrained(base_source)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    dst = tmp_path / "out"
    refuse(["convert", str(src), str(dst)], capsys, dst, src, "pass --allow-pickle")

    before = file_hashes(src)
    assert main(["convert", str(src), str(dst), "--allow-pickle"]) == 0  # verified: bit-identical
    assert "bit-identical" in capsys.readouterr().out
    assert file_hashes(src) == before


def test_src_inside_dst_or_dst_inside_src_is_refused(src, capsys):
    refuse(["convert", str(src), str(src / "out")], capsys, src / "out", src, "must not be SRC")


def test_yarn_without_original_length_is_refused(src, tmp_path, capsys):
    refuse(
        ["convert", str(src), str(tmp_path / "out"), "--yarn-factor", "4"],
        capsys,
        tmp_path / "out",
        src,
        "--yarn-factor needs --original-max-position-embeddings",
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_interruption_leaves_no_dst(tmp_path, sig):
    src = big_source(tmp_path / "big")
    before = file_hashes(src)
    dst = tmp_path / "out"
    # A child inherits an ignored SIGINT (a shell's background job has one), and Python then installs no
    # KeyboardInterrupt handler: give it the default disposition, as a terminal's Ctrl-C finds it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gated_attention", "convert", str(src), str(dst)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    # Wait until the first shard is being written into the staging folder, then interrupt.
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.incomplete-*/model*.safetensors")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "conversion never started writing"
        time.sleep(0.01)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "gated-attention convert: interrupted"
    assert not dst.exists()
    assert staging_leftovers(dst) == []
    assert file_hashes(src) == before


def test_successful_conversion_of_the_same_source_still_works(src, tmp_path):
    # The fixtures above are only worth something if the unbroken source converts.
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(reference(PROMPT).logits, result(PROMPT).logits)


# A field of the wrong type, as a hand-edited or badly exported config.json has it: one line naming the
# field, the value and the type expected (the type the family's transformers class declares).
WRONG_TYPES = [
    ("hidden_size", "64", "int"),
    ("num_attention_heads", "4", "int"),
    ("num_key_value_heads", 2.0, "int"),
    ("max_position_embeddings", "128", "int"),
    ("rms_norm_eps", "1e-6", "float"),
    ("attention_bias", "yes", "bool"),
    ("hidden_act", 3, "str"),
    ("eos_token_id", "2", "int"),
    ("rope_parameters", "llama3", "dict"),
    ("dtype", "float99", "a torch dtype"),
]


@pytest.mark.parametrize("field, value, expected", WRONG_TYPES, ids=[f for f, _, _ in WRONG_TYPES])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_config_field_of_the_wrong_type_is_named(src, tmp_path, capsys, field, value, expected, verify):
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    err = refuse(["convert", str(src), str(tmp_path / "out"), *([] if verify else ["--no-verify"])],
                 capsys, tmp_path / "out", src, f"{field} = {value!r}")  # fmt: skip
    assert f"expected {expected}" in err, err


def test_an_fla_config_field_of_the_wrong_type_is_named(tmp_path, capsys):
    from convert_helpers import make_fla_hybrid_source

    src = make_fla_hybrid_source(tmp_path / "fla", reference=tmp_path / "reference")
    config = json.loads((src / "config.json").read_text())
    config["num_heads"] = "2"
    (src / "config.json").write_text(json.dumps(config))
    err = refuse(["convert", str(src), str(tmp_path / "out")], capsys, tmp_path / "out", src, "num_heads = '2'")
    assert "expected int" in err


@pytest.mark.parametrize("command", ["extend", "export"])
def test_a_gated_config_field_of_the_wrong_type_is_named(tmp_path, capsys, command):
    from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM

    src = tmp_path / "gated"
    config = GatedAttentionConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, qk_norm=True, max_position_embeddings=64)  # fmt: skip
    GatedAttentionForCausalLM(config).save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    raw["num_attention_heads"] = "4"  # was: "not all arguments converted during string formatting"
    (src / "config.json").write_text(json.dumps(raw))
    argv = [command, str(src), str(tmp_path / "out"), *(["--rope-theta", "2e4"] if command == "extend" else ["--format", "qwen3_5"])]
    err = refuse(argv, capsys, tmp_path / "out", src, "num_attention_heads = '4'")
    assert "expected int" in err


# --- a broken source weight -----------------------------------------------------------------------------


def _poison(src: Path, name: str, index: tuple[int, ...], value: float) -> None:
    """Set one element of tensor `name` in SRC's safetensors files to `value`."""
    from safetensors.torch import load_file

    for shard in shards(src):
        state = load_file(shard)
        if name in state:
            state[name][index] = value
            save_file(state, shard, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} not in {src}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_non_finite_source_weight_is_reported_as_the_sources(src, tmp_path, capsys, value, verify):
    # was: "exact conversion changed the logits (max abs diff nan)", and with --no-verify a DST and exit 0
    _poison(src, "model.layers.1.mlp.down_proj.weight", (3, 5), value)
    err = refuse(["convert", str(src), str(tmp_path / "out"), *([] if verify else ["--no-verify"])], capsys,
                 tmp_path / "out", src, "SRC tensor model.layers.1.mlp.down_proj.weight holds ")  # fmt: skip
    assert f"holds {'NaN' if value != value else ('inf' if value > 0 else '-inf')} at [3, 5]" in err, err
    assert "verification" not in err


def test_a_non_finite_pickle_weight_is_reported(base_source, tmp_path, capsys):
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(base_source / "config.json", src)
    state = AutoModelForCausalLM.from_pretrained(base_source).state_dict()
    state["model.norm.weight"][7] = float("nan")
    torch.save(state, src / "pytorch_model.bin")
    refuse(["convert", str(src), str(tmp_path / "out"), "--allow-pickle", "--no-verify"], capsys, tmp_path / "out", src,
           "SRC tensor model.norm.weight holds NaN at [7]")  # fmt: skip


@pytest.mark.parametrize("command", ["extend", "export"])
def test_a_non_finite_weight_of_a_gated_source_is_reported(tmp_path, capsys, command):
    from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM

    src = tmp_path / "gated"
    config = GatedAttentionConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, qk_norm=True, max_position_embeddings=64)  # fmt: skip
    model = GatedAttentionForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.attn_gate.weight[1, 2] = float("inf")
    model.save_pretrained(src)
    argv = [command, str(src), str(tmp_path / "out"), *(["--rope-theta", "2e4"] if command == "extend" else ["--format", "qwen3_5"])]
    refuse(argv, capsys, tmp_path / "out", src, "SRC tensor model.layers.0.self_attn.attn_gate.weight holds inf at [1, 2]")


FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_the_finite_check_agrees_with_torch_isfinite_on_every_bit_pattern(dtype):
    """Every value a 1- or 2-byte format has (all 256 / 65536 bit patterns), and a sample of the wider ones."""
    from gated_attention.convert.sources import first_non_finite

    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    if dtype.itemsize <= 2:
        patterns = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int64).to(bits)
    else:  # the edges: largest finite, +-inf, NaNs of either sign with the smallest and largest payloads
        finfo = torch.finfo(dtype)
        values = torch.tensor([0.0, -0.0, 1.0, -2.5, finfo.max, -finfo.max, finfo.tiny, finfo.tiny / 4,
                               float("inf"), float("-inf"), float("nan")], dtype=dtype)  # fmt: skip
        width, mantissa = 8 * dtype.itemsize, {4: 23, 8: 52}[dtype.itemsize]  # exponent: bits mantissa .. width-2
        ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
        edges = [ones | 1, ones | ((1 << mantissa) - 1), (1 << (width - 1)) | ones | 1, ones - 1]  # NaN, NaN, -NaN, max
        unsigned = np.array(edges, dtype=np.uint32 if width == 32 else np.uint64)
        patterns = torch.cat([values.view(bits), torch.from_numpy(unsigned.view(np.int32 if width == 32 else np.int64))])
    values = patterns.view(dtype)
    finite = torch.isfinite(values.float() if dtype.itemsize == 1 else values)  # the reference
    for i in range(values.numel()):
        one = values[i : i + 1].clone()
        assert (first_non_finite(one) is None) == bool(finite[i]), (dtype, hex(int(patterns[i]) & 0xFFFFFFFF), one)
    mixed = values.clone()
    expected = int((~finite).nonzero()[0]) if (~finite).any() else None
    assert first_non_finite(mixed) == expected


def test_the_finite_check_finds_a_value_past_its_first_chunk():
    from gated_attention.convert import sources

    t = torch.zeros(3 * sources._CHECK_CHUNK + 5, dtype=torch.bfloat16)
    assert sources.first_non_finite(t) is None
    for i in (sources._CHECK_CHUNK + 7, t.numel() - 1):
        t[i] = float("-inf")
        assert sources.first_non_finite(t) == i
        t[i] = 0


@pytest.mark.parametrize(
    "name, value, args, expected",
    [
        ("model.layers.0.mlp.up_proj.weight", 1e6, ["--dtype", "float16"], "float16 cannot hold it"),
        ("model.layers.0.self_attn.o_proj.weight", 3e38, [], "doubling o_proj (--init exact) makes it inf"),
    ],
    ids=["to-float16", "doubled-o_proj"],
)
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_weight_the_conversion_would_make_inf_is_refused(src, tmp_path, capsys, name, value, args, expected, verify):
    # was: a DST with inf weights and exit 0 (the verification loads SRC in the same dtype, so it agrees)
    _poison(src, name, (2, 1), value)
    err = refuse(["convert", str(src), str(tmp_path / "out"), *args, *([] if verify else ["--no-verify"])], capsys,
                 tmp_path / "out", src, f"SRC tensor {name} holds {value:g} at [2, 1]: ")  # fmt: skip
    assert expected in err, err


def test_a_failure_while_writing_leaves_no_folder_it_made(src, tmp_path, capsys):
    _poison(src, "model.layers.0.mlp.up_proj.weight", (2, 1), 1e6)  # fails while writing: float16 cannot hold it
    dst = tmp_path / "new" / "deeper" / "out"
    refuse(["convert", str(src), str(dst), "--dtype", "float16"], capsys, dst, src, "float16 cannot hold it")
    assert not (tmp_path / "new").exists()
