"""Embedded data, the shared training loop, and `gated-attention quickstart --smoke` end to end."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gated_attention
from gated_attention.training import data
from gated_attention.training import GateScoreMeter, StepBatches, make_optimizer

MAX_CHARS = 150_000  # a corpus prefix, so the tokenizer trains in well under a second


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


# ---------------------------------------------------------------- data


def test_split_is_fixed_and_disjoint():
    train = data.corpus_split("train")
    valid = data.corpus_split("validation")
    names = {d.name for d in data.corpus_documents()}
    assert {d.name for d in train} | {d.name for d in valid} == names
    assert not {d.name for d in train} & {d.name for d in valid}
    assert [d.name for d in data.corpus_split("validation")] == [d.name for d in valid]  # same order every call
    assert any(n.startswith("pydoc:") for n in names) and any(n.startswith("stdlib:") for n in names)
    prefix = data.corpus_split("train", max_chars=MAX_CHARS)
    assert [d.name for d in prefix] == [d.name for d in train[: len(prefix)]]


def test_tokenizer_is_cached_and_loads_with_autotokenizer(cache):
    from transformers import AutoTokenizer

    folder = data.tokenizer_path(300, MAX_CHARS, cache)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert data.tokenizer_path(300, MAX_CHARS, cache) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp  # not trained again
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 300
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "def f(x):\n    return 'é' * x  # ünïcode"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # BOS first, as the models are trained
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: nothing is unknown


def test_pack_rows_start_with_bos_and_follow_the_stream():
    stream = np.arange(10, 33, dtype=np.int32)  # 23 tokens
    rows = data.pack(stream, seq_len=6, bos_id=1)  # 5 stream tokens per row -> 4 rows, 3 left over
    assert rows.shape == (4, 6)
    assert (rows[:, 0] == 1).all()
    assert torch.equal(rows[:, 1:].reshape(-1), torch.arange(10, 30))


# ---------------------------------------------------------------- training loop


def test_step_batches_cover_each_global_batch_once_and_are_reproducible():
    b = StepBatches(num_rows=10, global_batch=8, seed=3)
    first_epoch = torch.cat([b.indices(0), b.indices(1)[:2]])
    assert sorted(first_epoch.tolist()) == list(range(10))  # an epoch is a permutation
    assert torch.equal(StepBatches(10, 8, 3).indices(5), b.indices(5))  # a pure function of (seed, step)
    idx = b.indices(2)
    shards = [StepBatches.shard(idx, m, 2, r, 2) for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat(shards).sort().values, idx.sort().values)


def _tiny(gate):
    config = gated_attention.GatedAttentionConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        attn_gate=gate,
    )
    return gated_attention.GatedAttentionForCausalLM(config)


def test_gate_parameters_get_their_own_learning_rate():
    model = _tiny({"position": "G1", "bias": True})
    optimizer = make_optimizer(model, lr=1e-5, gate_lr=1e-3)
    by_lr = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            by_lr[id(p)] = group["lr"]
    for name, p in model.named_parameters():
        assert by_lr[id(p)] == (1e-3 if "attn_gate" in name else 1e-5), name


@pytest.mark.parametrize("gate", [{"position": "G1"}, {"position": "G1", "rank": 2}], ids=["full", "low-rank"])
def test_gate_meter_reads_exact_init_gates_as_one_half(gate):
    model = _tiny(gate)
    for name, p in model.named_parameters():
        if "attn_gate" in name:
            torch.nn.init.zeros_(p)  # the converter's exact init: every score is sigmoid(0) = 0.5
    with GateScoreMeter(model) as meter:
        model(input_ids=torch.randint(0, 64, (2, 5)))
        assert meter.pop() == 0.5
        assert math.isnan(meter.pop())  # nothing ran since
    with GateScoreMeter(_tiny(None)) as meter:
        assert math.isnan(meter.pop())


# ---------------------------------------------------------------- quickstart


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_quickstart_smoke_end_to_end(cache, tmp_path):
    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "gated_attention", "quickstart", "--smoke", "--out", str(out), "--cache", str(cache),
           "--threads", "1", "--no-progress", "--steps", "4", "--pretrain-steps", "4", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "are bit-identical" in proc.stdout  # the conversion was proved exact on validation data
    assert "val ppl" in proc.stdout and "F-Attn" in proc.stdout  # the table was printed

    results = {r["model"]: r for r in _read(out / "results.csv")}
    assert list(results) == ["scratch, no gate", "scratch, G1 gate", "Llama source (pretrained)",
                             "Llama source + continued", "converted + continued"]
    for name, r in results.items():
        for key in ("val_ppl", "ppl_long", "ppl_long_yarn", "f_attn", "m_act"):
            assert math.isfinite(float(r[key])), (name, key)
        gated = "G1" in name or "converted" in name
        assert (0 < float(r["gate_mean"]) < 1) if gated else math.isnan(float(r["gate_mean"])), name
    # Same init, same batches, same steps: our ungated model trains exactly like transformers'
    # Llama (the tolerance allows for summation-order differences; none are expected on CPU).
    assert float(results["scratch, no gate"]["val_ppl"]) == pytest.approx(
        float(results["Llama source (pretrained)"]["val_ppl"]), rel=1e-4)

    training = _read(out / "training.csv")
    assert {r["model"] for r in training} == {"scratch, no gate", "scratch, G1 gate", "Llama source + continued",
                                              "converted + continued"}
    assert len(training) == 4 * 4
    # each model's own step count: the continued runs go on after the source's 4 pretraining steps
    assert [int(r["step"]) for r in training if r["model"] == "scratch, G1 gate"] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in training if r["model"] == "converted + continued"] == [5, 6, 7, 8]
    layers = _read(out / "layers.csv")
    assert len(layers) == 5 * 2  # five models, two layers each
    for name in ("loss.png", "gate_score.png", "first_token_attention.png", "max_activation.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert (out / "converted" / "config.json").exists()


def test_quickstart_plots_keep_coincident_curves_visible_and_draw_uniform_attention(tmp_path, monkeypatch):
    """`report.draw_quickstart` on hand-written files: two models with the same per-layer values (the ungated
    scratch model and the Llama source are, by construction) are both visible and the legend says they are
    equal; first-token attention has the uniform-attention line; the continued run is drawn at its steps."""
    import json

    from gated_attention.recipes import report

    report.write_csv(tmp_path / "training.csv",
                     [{"model": "scratch, no gate", "step": i, "loss": 5 - 0.1 * i, "gate_score": ""} for i in (1, 2, 3)]
                     + [{"model": "converted + continued", "step": i, "loss": 4.8 - 0.1 * i, "gate_score": 0.5}
                        for i in (4, 5, 6)], ["model", "step", "loss", "gate_score"])
    values = {"scratch, no gate": (0.3, 0.2), "Llama source (pretrained)": (0.3, 0.2), "converted + continued": (0.25, 0.1)}
    report.write_csv(tmp_path / "layers.csv",
                     [{"model": m, "layer": l, "first_token_attention": v[l - 1], "max_activation": 10 * v[l - 1]}
                      for m, v in values.items() for l in (1, 2)], ["model", "layer", "first_token_attention", "max_activation"])
    (tmp_path / "settings.json").write_text(json.dumps({"seq_len": 4, "pretrain_steps": 3}))
    figures = {}

    def keep(fig, path):  # instead of saving: the figures are inspected here
        figures[path.name] = fig
        return path

    monkeypatch.setattr(report, "save_figure", keep)
    report.draw_quickstart(tmp_path)

    lines = {l.get_label(): l for l in figures["first_token_attention.png"].axes[0].get_lines()}
    scratch, source = lines["scratch, no gate"], lines["Llama source (pretrained) (= scratch, no gate)"]
    assert list(scratch.get_ydata()) == list(source.get_ydata())  # the same points ...
    assert source.get_linewidth() < scratch.get_linewidth() and source.get_color() != scratch.get_color()  # ... nested
    assert source.get_marker() != scratch.get_marker() and source.get_markersize() < scratch.get_markersize()
    uniform = lines["uniform causal attention over 4 tokens (0.361)"]  # (1/2 + 1/3 + 1/4) / 3
    assert list(uniform.get_ydata()) == [pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3)] * 2

    loss = {l.get_label(): l for l in figures["loss.png"].axes[0].get_lines()}
    assert list(loss["converted + continued"].get_xdata()) == [4, 5, 6]
    assert list(loss["conversion (after the source's 3 steps)"].get_xdata()) == [3, 3]
    # one colour per model in every plot
    assert loss["converted + continued"].get_color() == lines["converted + continued"].get_color()


# ---------------------------------------------------------------- device


def test_device_auto_follows_cuda_and_cuda_means_bf16_autocast(monkeypatch):
    from gated_attention.cli import CLIError
    from gated_attention.recipes.common import Placement, choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device("auto") == Placement(torch.device("cpu"), None)
    with pytest.raises(CLIError, match="--device cuda"):
        choose_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # simulated: nothing is moved to a GPU here
    for requested in ("auto", "cuda"):
        assert choose_device(requested) == Placement(torch.device("cuda"), torch.bfloat16)
    assert choose_device("cpu") == Placement(torch.device("cpu"), None)


def test_quickstart_parser_takes_device_and_defaults_to_auto():
    import argparse

    from gated_attention.recipes.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["quickstart"]).device == "auto"
    assert parser.parse_args(["quickstart", "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["quickstart", "--device", "tpu"])


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_train_runs_its_forwards_under_autocast_and_keeps_fp32_parameters(autocast_dtype):
    # CPU autocast takes the same path as CUDA's (`torch.autocast(device.type, dtype)`), so this runs anywhere.
    from gated_attention.training import TrainConfig, evaluate_loss, make_scheduler, train

    torch.manual_seed(0)
    model = _tiny({"position": "G1"})
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    config = TrainConfig(steps=2, batch_size=2, lr=1e-3, gate_lr=1e-3, autocast_dtype=autocast_dtype)
    optimizer = make_optimizer(model, config.lr, config.gate_lr)
    history = train(model, torch.randint(0, 64, (4, 8)), config, optimizer, make_scheduler(optimizer, 2, 1),
                    progress=False)
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert seen == [autocast_dtype or torch.float32] * 2  # one forward per step, in the autocast dtype
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    seen.clear()
    evaluate_loss(model, torch.randint(0, 64, (2, 8)), batch_size=2)
    assert seen == [torch.float32]  # evaluation is never under autocast


# ---------------------------------------------------------------- threads


@pytest.fixture
def torch_threads():
    """torch's thread count restored after the test (conftest runs the tests with one)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("load, expected", [(0.0, 2), (0.4, 2), (0.6, 1), (5.0, 1)], ids=lambda v: str(v))
def test_default_threads_are_the_free_cores(monkeypatch, torch_threads, load, expected):
    """2 usable cores: the default takes the ones the 1-minute load average leaves free, at least one
    (2 threads on a busy 2-core machine trained at a tenth of one thread's speed: benchmarks/threads.py)."""
    from gated_attention.training.threads import set_cpu_threads

    torch.set_num_threads(2)  # torch's default on this machine: the cap of the rule
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    threads, reason = set_cpu_threads()
    assert threads == expected == torch.get_num_threads()
    assert f"load average {load:.1f}" in reason
    assert set_cpu_threads(3) == (3, "--threads") and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # what torch read from OMP_NUM_THREADS at start-up
    assert set_cpu_threads() == (1, "OMP_NUM_THREADS")


def test_quickstart_without_threads_uses_the_free_cores_on_the_cpu(monkeypatch, torch_threads, tmp_path, capsys):
    import argparse

    from gated_attention.recipes.common import Job

    torch.set_num_threads(2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 4.0, 4.0))
    args = argparse.Namespace(out=str(tmp_path / "out"), cache=str(tmp_path / "cache"), device="cpu", threads=None)
    with Job.start(args, {}):
        assert torch.get_num_threads() == 1
    assert "1 torch thread(s) (free cores: 2 usable, load average 4.0)" in capsys.readouterr().out


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, flag", [
    (["--lr", "-1"], "--lr"), (["--lr", "0"], "--lr"), (["--gate-lr", "nan"], "--gate-lr"),
    (["--continue-lr", "inf"], "--continue-lr"), (["--steps", "0"], "--steps"), (["--pretrain-steps", "-2"], "--pretrain-steps"),
    (["--batch-size", "1.5"], "--batch-size"), (["--seq-len", "4"], "--seq-len"), (["--layers", "0"], "--layers"),
    (["--heads", "0"], "--heads"), (["--hidden-size", "-8"], "--hidden-size"), (["--vocab-size", "100"], "--vocab-size"),
    (["--long-factor", "1"], "--long-factor"), (["--eval-sequences", "0"], "--eval-sequences"), (["--seed", "-1"], "--seed"),
    (["--threads", "0"], "--threads"), (["--preset", "sinks", "--lr", "-1"], "--lr"),
    (["--preset", "sinks", "--weight-decay", "-0.1"], "--weight-decay"), (["--preset", "sinks", "--steps", "0"], "--steps"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_quickstart_refuses_a_value_out_of_range_when_parsing(argv, flag, capsys):
    from gated_attention.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["quickstart", *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"gated-attention quickstart: error: argument {flag}: expected "), last


@pytest.mark.parametrize("argv, message", [
    (["--weight-decay", "1"],
     "--weight-decay applies to --preset sinks, --preset trained, --preset backcopy and --preset stability only"),
    (["--source", "x.gguf"], "--source applies to --preset trained only"),
    (["--preset", "sinks", "--long-tokens", "64"], "--long-tokens applies to --preset trained only"),
    (["--remove-sink"], "--remove-sink applies to --preset trained only"),
    (["--preset", "trained", "--hidden-size", "64"],
     "--hidden-size applies to quickstart's main job, --preset sinks, --preset backcopy and --preset stability only"),
    (["--preset", "backcopy", "--vocab-size", "300"],
     "--vocab-size applies to quickstart's main job, --preset sinks and --preset stability only"),
    (["--preset", "trained", "--gates-first", "4", "--steps", "4"], "--gates-first 4 leaves no step of full training"),
    (["--corpus", "packages", "--architecture", "hybrid"], "--architecture, --corpus apply to --preset sinks only"),
    (["--preset", "sinks", "--long-factor", "3"], "--long-factor applies to quickstart's main job"),
    (["--preset", "sinks", "--continue-lr", "1e-4"], "--continue-lr applies to quickstart's main job"),
    (["--hidden-size", "100", "--heads", "3"], "the head size must be a whole, even number"),
    (["--hidden-size", "12", "--heads", "4"], "the head size must be a whole, even number"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_quickstart_refuses_flags_that_do_not_go_together_before_importing_torch(argv, message, tmp_path):
    """One line, exit 2, before torch is imported and before anything is written."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gated_attention", "quickstart", *argv,
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if not l.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("gated-attention quickstart: error: ") and message in lines[0], lines
    assert not any(l.rsplit("|", 1)[-1].strip().split(".")[0] == "torch" for l in proc.stderr.splitlines()
                   if l.startswith("import time:"))
    assert not out.exists()


def test_quickstart_help_shows_each_jobs_defaults_and_where_each_flag_applies(capsys):
    from gated_attention.cli import build_parser
    from gated_attention.recipes.settings import BackcopySettings, Settings, SinkSettings

    with pytest.raises(SystemExit):
        build_parser().parse_args(["quickstart", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    main, sinks, backcopy = Settings(), SinkSettings(), BackcopySettings()
    for flag, field in (("--steps", "steps"), ("--batch-size", "batch_size"), ("--layers", "num_hidden_layers"),
                        ("--lr", "lr")):
        want = f"default {getattr(main, field):g}; --preset sinks: {getattr(sinks, field):g}"
        assert want in text, (flag, want)
    assert "--preset sinks: the --lr value; --preset backcopy: the --lr value" in text  # --gate-lr
    # --weight-decay: the first job's default, then where another differs, then the jobs that read it
    assert (f"(default {sinks.weight_decay:g}; --preset backcopy: {backcopy.weight_decay:g}); --preset sinks, "
            "--preset trained, --preset backcopy and --preset stability only") in text
    assert "(default 4); quickstart's main job only" in text  # --long-factor


def test_the_flag_table_covers_every_setting_flag_and_names_real_fields():
    """`settings.FLAGS` is the one place that says which job reads which flag: every quickstart flag that sets a
    job's settings is in it, and every job it names has that field; a job refuses every flag it does not read."""
    import argparse
    import dataclasses

    from gated_attention.cli import build_parser
    from gated_attention.recipes import settings

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    where = {"out", "smoke", "preset", "device", "threads", "cache", "no_progress", "help"}  # how and where a job runs
    dests = {a.dest for a in sub.choices["quickstart"]._actions} - where
    assert dests <= set(settings.FLAGS), dests - set(settings.FLAGS)
    for dest, jobs in settings.FLAGS.items():
        for job in jobs:
            assert dest in {f.name for f in dataclasses.fields(settings.JOBS[job][0])}, (dest, job)
    for job in settings.JOBS:
        for dest in {d for d, jobs in settings.FLAGS.items() if job not in jobs}:
            with pytest.raises(gated_attention.CLIError, match=f"^--{dest.replace('_', '-')} applies to "):
                settings._from_flags(job, argparse.Namespace(**{dest: 2}))