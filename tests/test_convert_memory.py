"""`--max-memory`: a model larger than the budget still converts and verifies bit-identically, with what does not
fit read from disk; a budget too small for one layer is one line, exit 2, nothing written."""

from __future__ import annotations

import gc
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from convert_helpers import PROMPT, file_hashes, make_fla_hybrid_source, make_gated, make_source, staging_leftovers
from gated_attention.cli import main
from gated_attention.convert.errors import ConversionError
from gated_attention.convert.verify import run_prompt, verify_against_source
from gated_attention.memory.budget import MemoryBudget

pytestmark = pytest.mark.usefixtures("weights_only_budget")  # budgets of kilobytes for models of kilobytes

# Between each tiny model's largest layer and its size in bf16, so that both sides run partly from disk (the fp32
# fla source with room beside its largest layer for one of its fp32 tensors, read before its cast).
BUDGETS = {"llama": "110KB", "qwen3_moe": "110KB", "fla_hybrid": "240KB"}
# Weights read from disk while the prompt ran, as the verification's log line says: one for SRC, one for DST.
FROM_DISK = re.compile(r"verifying: (?:SRC|DST|the ungated reference) ran with ([\d.]+ \w+) of ([\d.]+ \w+) of weights read from disk")
# How the budget is split, said once a run, before the first model loads (here the process's share is 0 B:
# `weights_only_budget`).
SPLIT = re.compile(r"^--max-memory [\d.]+ KB: 0 B this process, [\d.]+ K?B running reserve, [\d.]+ KB for weights$",
                   re.MULTILINE)


def said_split_once(out: str) -> bool:
    """One split line, before the first model ran (a convert loads SRC, then DST)."""
    found = list(SPLIT.finditer(out))
    return len(found) == 1 and found[0].start() < FROM_DISK.search(out).start()


@pytest.mark.parametrize("family", sorted(BUDGETS))
def test_a_budget_smaller_than_the_model_converts_and_verifies_bit_identically(tmp_path, capsys, family):
    if family == "fla_hybrid":  # the verification's reference is SRC's weights renamed while loading
        src, reference = make_fla_hybrid_source(tmp_path / "src", reference=tmp_path / "reference"), tmp_path / "reference"
    else:
        src = reference = make_source(family, tmp_path / "src")
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--max-memory", BUDGETS[family]]) == 0
    out = capsys.readouterr().out
    assert f"verifying within {BUDGETS[family][:-2]}.00 KB (--max-memory)" in out, out
    assert len(FROM_DISK.findall(out)) == 2, out  # each side ran partly from disk
    assert said_split_once(out), out
    assert "bit-identical after every layer and in the logits" in out
    assert not list(dst.rglob(".offload-*")) and staging_leftovers(dst) == []

    # The result is right, whatever the verification said: every weight in memory, source against result.
    expected = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16).eval()
    result = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        assert torch.equal(expected(PROMPT).logits, result(PROMPT).logits)


def test_a_bf16_source_verified_in_fp32_is_read_in_bf16_and_cast_as_it_runs(tmp_path, capsys, monkeypatch):
    """`convert --dtype float32` on a bf16 SRC within a budget below the model: SRC is loaded in bf16, so that its
    layers on disk are not read (and cast) while loading, and cast as they run; the result, stored in fp32, loads
    as it is. bf16 -> fp32 is exact: the verification is bit-identical."""
    from transformers import AutoModelForCausalLM as Auto

    make_source("llama", tmp_path / "fp32")
    src = tmp_path / "src"
    Auto.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(src)
    loads = []
    original = Auto.from_pretrained.__func__

    def recording(cls, folder, *args, **kwargs):
        loads.append((Path(folder).name, kwargs.get("dtype")))
        return original(cls, folder, *args, **kwargs)

    monkeypatch.setattr(Auto, "from_pretrained", classmethod(recording))
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--dtype", "float32", "--max-memory", "300KB"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical after every layer and in the logits" in out
    assert len(FROM_DISK.findall(out)) == 2, out
    assert loads[0] == ("src", torch.bfloat16) and loads[-1][1] == torch.float32, loads


@pytest.mark.parametrize("family", ["llama", "fla_hybrid"])
def test_an_fp32_source_verified_in_bf16_is_read_in_fp32_and_cast_as_it_runs(tmp_path, capsys, monkeypatch, family):
    """`convert --dtype bfloat16` on an fp32 SRC within a budget below the model: SRC is loaded in fp32, so that its
    layers on disk are not read (and cast) while loading, and cast as they run. The cast narrows, so it is not
    exact against SRC in fp32; but it is the cast transformers' own load in bf16 makes, tensor for tensor (RoPE's
    float32 inv_freq kept), so DST and the verification's line are the unbudgeted run's. The fla hybrid's
    reference is SRC's weights renamed into our model while loading."""
    from transformers import AutoModelForCausalLM as Auto

    if family == "fla_hybrid":
        src, reference = make_fla_hybrid_source(tmp_path / "src", reference=tmp_path / "reference"), tmp_path / "reference"
    else:
        src = reference = make_source(family, tmp_path / "src")
    loads = []  # (folder, dtype asked for, the model) of each from_pretrained
    original = Auto.from_pretrained.__func__

    def recording(cls, folder, *args, **kwargs):
        loaded = original(cls, folder, *args, **kwargs)
        loads.append((Path(folder).name, kwargs.get("dtype"), loaded[0] if isinstance(loaded, tuple) else loaded))
        return loaded

    monkeypatch.setattr(Auto, "from_pretrained", classmethod(recording))
    verify_lines = {}
    for name, budget in [("whole", "1GB"), ("budget", BUDGETS[family])]:
        loads.clear()
        assert main(["convert", str(src), str(tmp_path / name), "--dtype", "bfloat16", "--max-memory", budget]) == 0
        out = capsys.readouterr().out
        assert "bit-identical after every layer and in the logits" in out, out
        assert len(FROM_DISK.findall(out)) == (2 if name == "budget" else 0), out
        verify_lines[name] = [line for line in out.splitlines() if line.startswith("verify:")]
        if name == "whole":  # all in memory: transformers casts as it loads, as before
            assert loads[0][1] == torch.bfloat16, loads
    assert loads[0][1] == torch.float32, loads  # within the budget: SRC is loaded as it is stored
    assert verify_lines["budget"] == verify_lines["whole"] and len(verify_lines["whole"]) == 1
    shards = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert shards and sorted(p.name for p in (tmp_path / "budget").glob("*.safetensors")) == shards
    for shard in shards:
        assert (tmp_path / "budget" / shard).read_bytes() == (tmp_path / "whole" / shard).read_bytes(), shard

    # The budgeted SRC, once cast: each tensor (the offloaded ones on the meta device) in the dtype that
    # transformers' own load in bf16 gives it, the rotary tables in float32.
    cast = loads[0][2]
    expected = original(Auto, reference, dtype=torch.bfloat16)
    ours = {n: t.dtype for n, t in (*cast.named_parameters(), *cast.named_buffers())}
    assert ours == {n: t.dtype for n, t in (*expected.named_parameters(), *expected.named_buffers())}
    assert {dtype for n, dtype in ours.items() if "inv_freq" in n} == {torch.float32}
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["llama", "hybrid"])
def test_an_fp32_checkpoint_run_in_bf16_within_a_budget_gives_the_bits_of_a_whole_bf16_load(tmp_path, family):
    """The verification's run of one fp32 checkpoint in bf16, every hidden state and the logits: partly from disk
    (loaded in fp32 and cast, the layers on disk as they are read) against whole in memory (cast by transformers
    as it loads). A narrowed inv_freq would move every layer after the first attention."""
    if family == "hybrid":  # our hybrid, fp32, in one file
        make_fla_hybrid_source(tmp_path / "fla", reference=tmp_path / "src")
        folder, budget = tmp_path / "src", 200_000
    else:
        folder, budget = make_source(family, tmp_path / "src"), 110_000
    kwargs = dict(dtype=torch.bfloat16, vocab_size=97, max_positions=16, offload_dir=tmp_path)
    budgeted = run_prompt(folder, MemoryBudget(budget, True), **kwargs)
    whole = run_prompt(folder, MemoryBudget(1 << 30, True), **kwargs)
    assert budgeted.offloaded_bytes > 0 and whole.offloaded_bytes == 0
    assert len(budgeted.hidden_states) == len(whole.hidden_states)
    for i, (a, b) in enumerate(zip(budgeted.hidden_states, whole.hidden_states)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), f"hidden state {i}"
    assert torch.equal(budgeted.logits, whole.logits)


def test_a_difference_in_a_layer_read_from_disk_is_found_and_named(tmp_path, capsys):
    """The layer-by-layer comparison sees a change in an offloaded layer, and names the first layer it shows in."""
    src = make_source("llama", tmp_path / "src", num_hidden_layers=3)
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--no-verify"]) == 0
    shard = next(p for p in dst.glob("*.safetensors") if "model.layers.1.mlp.down_proj.weight" in load_file(p))
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.down_proj.weight"][:, 0] += 1.0  # layer 2 of 3, counted from 1; large enough for bf16
    save_file(tensors, shard, metadata={"format": "pt"})
    capsys.readouterr()

    config = AutoConfig.from_pretrained(dst)
    with pytest.raises(ConversionError, match=r"changed the outputs, first in layer 2's output \(max abs logits diff"):
        verify_against_source(src, dst, config, torch.bfloat16, {}, True, print, MemoryBudget(110_000, True))
    placed = FROM_DISK.findall(capsys.readouterr().out)
    assert len(placed) == 2  # both sides ran partly from disk


@pytest.mark.parametrize("budget", [110_000, 1 << 30], ids=["partly on disk", "whole in memory"])
def test_each_verified_model_is_freed_before_the_next_loads(tmp_path, budget):
    """A model accelerate dispatched stays alive in reference cycles after its last reference goes, until a
    collection; one whole in memory is freed by that reference alone. Either way nothing of it is left."""
    src = make_source("llama", tmp_path / "src")

    def models() -> set[int]:
        return {id(o) for o in gc.get_objects() if isinstance(o, PreTrainedModel)}

    gc.collect()
    before = models()
    run = run_prompt(src, MemoryBudget(budget, True), dtype=torch.bfloat16, vocab_size=97, max_positions=16,
                     offload_dir=tmp_path)  # fmt: skip
    assert (run.offloaded_bytes > 0) == (budget == 110_000)
    assert models() - before == set()


@pytest.mark.parametrize("command", ["extend", "export"])
def test_extend_and_export_verify_within_a_budget_smaller_than_the_model(tmp_path, capsys, command):
    src = make_gated(tmp_path / "gated")
    argv = [command, str(src), str(tmp_path / "out"), "--max-memory", "60KB",
            *(["--rope-theta", "2e4"] if command == "extend" else ["--format", "qwen3_5"])]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(FROM_DISK.findall(out)) == 2, out
    assert said_split_once(out), out
    assert ("bit-identical after every layer" if command == "extend" else "verify: max |logits(SRC) - logits(DST)|") in out


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
def test_a_budget_too_small_for_one_layer_is_one_line_and_writes_nothing(tmp_path, capsys, command):
    src = make_source("llama", tmp_path / "src") if command == "convert" else make_gated(tmp_path / "src")
    before = file_hashes(src)
    dst = tmp_path / "out"
    extra = {"convert": [], "extend": ["--rope-theta", "2e4"], "export": ["--format", "qwen3_5"]}[command]
    capsys.readouterr()
    assert main([command, str(src), str(dst), "--max-memory", "5KB", *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert re.match(rf"gated-attention {command}: error: --max-memory 5\.00 KB is too small for one layer: "
                    r"model\.\S+ needs [\d.]+ KB in \w+; give a larger --max-memory", lines[0]), lines[0]  # fmt: skip
    assert "nothing was written" in lines[0]
    assert not dst.exists() and staging_leftovers(dst) == [] and file_hashes(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_tensor_read_beside_its_cast_is_reserved_before_anything_is_written(tmp_path, capsys):
    """An fp32 SRC verified (and written) in bf16 holds a weight's fp32 bytes beside its cast: a budget that holds
    the largest bf16 layer and not that is refused like one below the layer."""
    src = make_fla_hybrid_source(tmp_path / "src", reference=tmp_path / "reference")  # fp32
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "out"), "--dtype", "bfloat16", "--max-memory", "200KB"]) == 2
    err = capsys.readouterr().err
    largest = max(t.numel() * 4 for shard in src.glob("*.safetensors") for t in load_file(shard).values())
    assert re.search(rf"model\.layers\.\d+ needs [\d.]+ KB in bfloat16, running the model {largest / 1000:.2f} KB more;",
                     err), err  # fmt: skip
    assert not (tmp_path / "out").exists() and staging_leftovers(tmp_path / "out") == []


def test_without_verification_the_budget_bounds_nothing_and_is_not_checked(tmp_path):
    """The conversion alone holds one tensor at a time: a budget below one layer is no reason to refuse it."""
    src = make_source("llama", tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "out"), "--max-memory", "5KB", "--no-verify"]) == 0
    shutil.rmtree(tmp_path / "out")


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
def test_the_help_says_the_budget_is_the_whole_process_and_its_split_is_printed(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the verification's whole process may hold, Python, torch and the libraries included" in text
    assert "The split (this process, running reserve, weights) is printed once, at the start of the verification" in text
