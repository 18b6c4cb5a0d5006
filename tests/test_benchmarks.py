"""The GPU benchmark scripts on a machine without a GPU: they skip cleanly, and `--smoke` runs them tiny.

`--smoke` runs every code path of the scripts (peer detection and skip reasons, tables, CSV, the model
parts) on the CPU, where the fused path is the torch reference; it checks that the scripts still work,
never their speed. The scripts are loaded from their files and their `main` called in this process.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gated_sdpa", "gpu_models"])
def test_without_cuda_the_scripts_skip_and_exit_0(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load(name).main([]) == 0
    assert "no CUDA: skipped" in capsys.readouterr().out


def test_gated_sdpa_benchmark_smoke(tmp_path, capsys):
    assert load("gated_sdpa").main(["--smoke", "--csv", str(tmp_path / "rows.csv")]) == 0
    out = capsys.readouterr().out
    assert "sdpa [" in out, out  # the default dispatch names the backend it picked
    with open(tmp_path / "rows.csv") as f:
        rows = list(csv.DictReader(f))
    assert {row["kind"] for row in rows} == {"prefill", "decode"}
    assert {row["path"] for row in rows} >= {"fused", "flash"}  # the CPU runs SDPA's flash backend when forced
    # Every peer computes the same attention as the fused path (here the fp32 torch reference).
    assert max(float(row["max_abs_diff"]) for row in rows) < 1e-5


def test_gpu_models_smoke(capsys):
    assert load("gpu_models").main(["--smoke", "--parts", "train", "generate", "agree", "moe"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal over 4 new tokens: True" in out, out


@pytest.mark.slow
def test_gpu_models_smoke_compile_and_hybrid(capsys):
    """fullgraph torch.compile of a "gated_triton" model (the reference path here) and the hybrid against
    transformers' Qwen3.5: tens of seconds on a CPU."""
    assert load("gpu_models").main(["--smoke", "--parts", "compile", "hybrid"]) == 0
    assert "no graph break" in capsys.readouterr().out


def test_fla_cpu_benchmark_smoke(capsys):
    """benchmarks/fla_cpu.py at tiny shapes: every mixer against its peers (the outputs agree), and the hybrid's
    decode against transformers' Qwen3.5 with the exported weights (the same logits)."""
    argv = ["--smoke", "--repeats", "1", "--length", "64", "--prompt", "6", "--decode-steps", "2", "--threads", "1"]
    assert load("fla_cpu").main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "naive recurrent" in line and not line.startswith("targets")]
    assert {row[0] for row in rows} == {"gla", "retnet", "hgrn", "hgrn2", "delta_net", "gated_deltanet", "kda"}, out
    assert all(float(row[-1]) < 1e-4 for row in rows), out  # max|diff| against fla's naive references
    assert "capture overhead" in out  # analyze against a plain forward of fla's hybrid
    assert "transformers (Qwen3.5)" in out and "transformers (Kimi Linear)" in out
    decode = [line for line in out.splitlines() if "last logits max|diff|" in line]
    assert len(decode) == 2 and all(float(line.rsplit(" ", 1)[-1].rstrip(")")) < 1e-5 for line in decode), out


def test_sink_search_runs_the_preset_for_the_ungated_model_alone(tmp_path, capsys):
    """benchmarks/sink_search.py parses quickstart's flags plus its own, and trains only the ungated model."""
    argv = ["--smoke", "--ungated-only", "--weight-decay", "0.5", "--threads", "1", "--no-progress",
            "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]
    assert load("sink_search").main(argv) == 0
    assert "wall time" in capsys.readouterr().out
    with open(tmp_path / "out" / "layers.csv") as f:
        assert {row["model"] for row in csv.DictReader(f)} == {"no gate"}


def test_stability_search_trains_the_control_alone_with_its_schedule_flags(tmp_path, capsys):
    """benchmarks/stability_search.py parses quickstart's flags plus the schedule's, and trains only the control."""
    import json

    out = tmp_path / "out"
    argv = ["--smoke", "--lrs", "0.001,0.01", "--max-grad-norm", "0", "--warmup-fraction", "0.5", "--threads", "1",
            "--no-progress", "--out", str(out), "--cache", str(tmp_path / "cache")]
    assert load("stability_search").main(argv) == 0
    assert "wall time" in capsys.readouterr().out
    with open(out / "results.csv") as f:
        assert [(row["model"], row["lr"]) for row in csv.DictReader(f)] == [("control", "0.001"), ("control", "0.01")]
    written = json.loads((out / "settings.json").read_text())
    assert (written["max_grad_norm"], written["warmup_fraction"], written["arms"]) == (0, 0.5, ["control"])


# A value out of range for each script's own flags (serving_engines is the serving check's library: no flags).
OUT_OF_RANGE = {
    "analysis_overhead": ["--repeats", "0"],
    "backcopy_search": ["--probe-every", "-1"],
    "convert": ["--repeats", "0"],
    "convert_memory": ["--budgets", "1GB", "0GB"],
    "fla_cpu": ["--repeats", "0"],
    "gate_overhead": ["--layers", "0"],
    "gate_precision": ["--tokens", "0"],
    "gated_sdpa": ["--seqlens", "1024", "0"],
    "gdn_cpu": ["--lengths", "-5"],
    "gguf_quant": ["--sequences", "0"],
    "gpu_models": ["--parts", "everything"],
    "llmcompressor_agreement": ["--rows", "0"],
    "long_document": ["--mb", "0"],
    "quantization_pairs": ["--steps", "0"],
    "quantized_serving": ["--repeats", "0"],
    "serving_check": ["--prompts", "0"],
    "sink_search": ["--probe-every", "-1"],
    "stability_search": ["--max-grad-norm", "-1"],
    "startup": ["--repeats", "0"],
    "stream_memory": ["--steps", "0"],
    "tensor_parallel_memory": ["--tp", "0"],
    "threads": ["--steps", "3"],  # the first three steps are not timed
}


def test_every_benchmark_with_flags_is_listed_here():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if "\ndef main(" in p.read_text(encoding="utf-8")}
    # serving_engines: the serving check's library; analyze_catalog and convert_catalog: no flag with a range (model
    # types and a path; a type transformers does not ship is reported as NEW, which is the catalog's job)
    assert scripts - {"serving_engines", "analyze_catalog", "convert_catalog"} == set(OUT_OF_RANGE)


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_a_bad_flag_value_is_one_line_before_anything_runs(name, monkeypatch, capsys):
    """The benchmarks share the commands' parser (`cli_common`): a range error names the flag in one line,
    exit 2, and nothing is measured."""
    monkeypatch.setattr("sys.argv", [f"{name}.py", *OUT_OF_RANGE[name]])
    with pytest.raises(SystemExit) as exit_info:
        load(name).main()
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and not captured.out, captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"error: argument {OUT_OF_RANGE[name][0]}" in lines[0], lines
    assert lines[0].endswith(f"(see {name}.py --help)"), lines
