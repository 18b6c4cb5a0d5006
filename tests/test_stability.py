"""`gated-attention quickstart --preset stability`: the learning-rate sweep at smoke size, its rules on hand-made
tables, and a run forced to diverge."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import gated_attention
from gated_attention.recipes import report, settings, stability


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _args(out: Path, cache: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), cache=str(cache), smoke=True, threads=1, no_progress=True,
                              preset="stability", **extra)


# ---------------------------------------------------------------- the rules, on hand-made tables


def test_lr_sensitivity_caps_at_the_initial_loss_and_counts_a_diverged_run_as_it():
    # capped: 3.0, 2.5, 7.0 (NaN: diverged), 7.0 (7.5 is above the initial loss) -> mean 4.875, best 2.5
    assert stability.lr_sensitivity([3.0, 2.5, math.nan, 7.5], initial_loss=7.0) == pytest.approx(2.375)
    assert stability.lr_sensitivity([4.0, 4.0], initial_loss=7.0) == 0.0
    # nothing trains (--lrs 1e30,1e35): undefined, not the 0 of "every rate ends as well as the best"
    assert math.isnan(stability.lr_sensitivity([math.inf, math.nan], initial_loss=7.0))
    assert math.isnan(stability.lr_sensitivity([7.5, math.nan], initial_loss=7.0))
    rows = [{"model": m, "lr": lr, "final_loss": math.nan, "best_loss": 7.0, "diverged": True}
            for m in ("control", "gated") for lr in (1e30, 1e35)]
    v = stability.verdict(rows, stability.sensitivities(rows, {"control": 7.0, "gated": 7.0}))
    assert math.isnan(v.sensitivity["control"]) and v.ratio is None and not v.halved
    assert "no rate trains the control" in report.stability_goal_lines(v)[1]
    rows = [{"model": m, "lr": lr, "final_loss": f} for m, lr, f in
            [("control", 0.01, 3.0), ("control", 0.1, 5.0), ("gated", 0.01, 3.2), ("gated", 0.1, 3.4)]]
    sens = stability.sensitivities(rows, {"control": 7.0, "gated": 6.9})
    assert sens == [{"model": "control", "lr_sensitivity": pytest.approx(1.0), "initial_loss": 7.0},
                    {"model": "gated", "lr_sensitivity": pytest.approx(0.1), "initial_loss": 6.9}]


def test_max_spike_is_the_largest_rise_of_the_smoothed_loss_over_its_running_minimum():
    assert stability.max_spike([5.0, 4.0, 3.0], smoothing=0.0) == 0.0  # never rises
    assert stability.max_spike([5.0, 3.0, 4.5, 2.0, 2.5], smoothing=0.0) == pytest.approx(1.5)  # 3.0 -> 4.5
    # EMA 0.5: 4, 4, 6 (over a minimum of 4) -> 2, then 5, 4.5; the finite prefix only
    assert stability.max_spike([4.0, 4.0, 8.0, 4.0, math.nan, 100.0], smoothing=0.5) == pytest.approx(2.0)
    assert math.isnan(stability.max_spike([], smoothing=0.9))


def _row(model, lr, final, best, diverged=False):
    return {"model": model, "lr": lr, "final_loss": final, "best_loss": best, "diverged": diverged}


def test_the_goal_is_judged_at_the_highest_rate_where_the_control_fails():
    rows = [_row("control", 0.01, 3.0, 3.0), _row("control", 0.1, 3.8, 3.0), _row("control", 1.0, 7.0, 6.0, True),
            _row("gated", 0.01, 3.0, 3.0), _row("gated", 0.1, 3.05, 3.0), _row("gated", 1.0, 3.1, 3.05)]
    v = stability.verdict(rows, stability.sensitivities(rows, {"control": 7.0, "gated": 7.0}))
    assert v.sensitivity == {"control": pytest.approx(1.6), "gated": pytest.approx(0.05)}
    assert v.ratio == pytest.approx(0.05 / 1.6) and v.halved
    sweep, run = v.failures
    # control: 1.0 diverged (and 0.1 ended 0.8 above its sweep's best); judged at 1.0
    assert (sweep.reading, sweep.lr, sweep.control["diverged"], sweep.control_best) == ("sweep", 1.0, True, 3.0)
    assert (sweep.gated_best, sweep.gated_excess) == (3.0, pytest.approx(0.1)) and sweep.held  # 0.1 itself counts
    # against each run's own lowest held-out loss: the control fails at 0.1 (3.8 vs 3.0) and 1.0; gated 3.1 vs 3.05
    assert (run.reading, run.lr, run.gated_best, run.gated_excess) == ("run", 1.0, 3.05, pytest.approx(0.05)) and run.held

    calm = [_row("control", 0.01, 3.0, 3.0), _row("control", 0.1, 3.2, 3.1), _row("gated", 0.01, 3.0, 3.0),
            _row("gated", 0.1, 3.2, 3.1)]
    v = stability.verdict(calm, stability.sensitivities(calm, {"control": 7.0, "gated": 7.0}))
    assert [f.lr for f in v.failures] == [None, None] and not any(f.held for f in v.failures)


def test_the_verdict_is_written_from_its_figures():
    rows = [_row("control", 0.01, 3.0, 3.0), _row("control", 0.1, 7.0, 6.0, True),
            _row("gated", 0.01, 3.0, 3.0), _row("gated", 0.1, 3.1, 3.05)]
    v = stability.verdict(rows, stability.sensitivities(rows, {"control": 7.0, "gated": 7.0}))
    lines = report.stability_goal_lines(v)
    assert lines[0] == "learning-rate sensitivity: control 2.0000, gated 0.0500"
    assert lines[1] == "the goal, gated against control: sensitivity at most half (0.0500 vs 2.0000, 0.02x: met)"
    assert lines[2].startswith("highest rate where the control fails against its sweep's best final loss: 0.1 "
                               "(control diverged, ended at 7.0000, sweep's best 3.0000)")
    assert lines[3].endswith("0.0500 above its run's best 3.0500 (within 0.1: met)")


# ---------------------------------------------------------------- the attention-logit probe


def test_the_logit_probe_reads_only_the_causal_positions_and_changes_nothing():
    """q and k by hand: the largest |q.k| sits above the diagonal (a future key), where it must not count."""
    q = torch.zeros(1, 1, 3, 2)
    k = torch.zeros(1, 1, 3, 2)
    q[0, 0, 0] = torch.tensor([1.0, 0.0])
    k[0, 0, 0] = torch.tensor([2.0, 0.0])  # q0.k0 = 2: allowed
    k[0, 0, 2] = torch.tensor([100.0, 0.0])  # q0.k2 = 100: the future
    q[0, 0, 2] = torch.tensor([0.0, -3.0])
    k[0, 0, 1] = torch.tensor([0.0, 1.0])  # q2.k1 = -3: allowed, |-3| the largest
    v = torch.randn(1, 1, 3, 2)
    module = torch.nn.Module()
    module.is_causal = True
    stability._LARGEST.clear()
    out, _ = stability._logit_probe_forward(module, q, k, v, None, scaling=0.5, dropout=0.0)
    assert stability._LARGEST == [1.5]  # |-3| x 0.5
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert torch.equal(out, sdpa_attention_forward(module, q, k, v, None, scaling=0.5, dropout=0.0)[0])


def test_logit_metrics_agree_with_the_model_and_the_analysis_toolkit():
    from gated_attention.analysis import metrics
    from gated_attention.analysis.capture import Capture

    torch.manual_seed(0)
    config = gated_attention.GatedAttentionConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, num_key_value_heads=1, qk_norm=True)
    model = gated_attention.GatedAttentionForCausalLM(config).eval()
    rows = torch.randint(0, 40, (2, 9))
    m = stability.logit_metrics(model, rows)
    assert model.config._attn_implementation == "sdpa"  # restored
    with torch.no_grad(), Capture(model, residual=True, attentions=False, gates=False) as cap:
        logits = [model(input_ids=x[None]).logits.abs().max().item() for x in rows]
        m_act = [metrics.m_act(r.residual_stack()[:, 0].numpy()) for r in cap.records]
    assert m["max_output_logit"] == pytest.approx(max(logits), rel=1e-6)
    assert m["m_act"] == pytest.approx(np.mean(m_act), rel=1e-6)
    assert 0 < m["max_attn_logit"] < math.inf


# ---------------------------------------------------------------- the preset


@pytest.mark.slow
def test_stability_preset_smoke_writes_every_column_and_plot(tmp_path, capsys):
    from gated_attention.recipes import cli

    out = tmp_path / "stability"
    assert cli.run(_args(out, tmp_path / "cache")) == 0  # as `gated-attention quickstart --preset stability --smoke`
    printed = capsys.readouterr().out
    s = settings.StabilitySettings(**settings.STABILITY_SMOKE)
    results = _read(out / "results.csv")
    assert list(results[0]) == ["model", "lr", "final_loss", "best_loss", "diverged", "max_spike", "max_attn_logit",
                                "max_output_logit", "m_act"]
    assert [(r["model"], float(r["lr"])) for r in results] == [(m, lr) for lr in s.lrs for m in s.arms]
    assert len(s.lrs) >= 6 and s.arms == ("control", "gated", "qk_norm")
    for r in results:
        for column in ("final_loss", "best_loss", "max_spike", "max_attn_logit", "max_output_logit", "m_act"):
            assert math.isfinite(float(r[column])), (r["model"], r["lr"], column)
        assert r["diverged"] in ("True", "False")
        assert float(r["best_loss"]) <= float(r["final_loss"])
        assert f"{float(r['final_loss']):.4f}" in printed  # the printed table is the CSV
    first = (out / "sensitivity.csv").read_text().splitlines()[0]
    assert first.startswith("# lr_sensitivity (Wortsman et al. 2023): the mean over the swept learning rates")
    sens = _read(out / "sensitivity.csv")
    assert [r["model"] for r in sens] == list(s.arms) and list(sens[0]) == ["model", "lr_sensitivity", "initial_loss"]
    for r in sens:  # the rule, recomputed from the two files
        finals = [float(x["final_loss"]) for x in results if x["model"] == r["model"]]
        assert float(r["lr_sensitivity"]) == pytest.approx(stability.lr_sensitivity(finals, float(r["initial_loss"])))
    training = _read(out / "training.csv")
    batches = {m: [r["batch"] for r in training if r["model"] == m and float(r["lr"]) == s.lrs[0]] for m in s.arms}
    assert batches["control"] == batches["gated"] == batches["qk_norm"] and len(batches["control"]) == s.steps
    assert "learning-rate sensitivity: control" in printed
    for name in ("lr_sweep.png", "loss_at_highest_lr.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.slow
def test_a_huge_rate_is_reported_as_diverged_without_a_crash_or_a_nan_in_the_plot(tmp_path, monkeypatch):
    from gated_attention.recipes import cli

    figures = {}

    def keep(fig, path):  # instead of saving: the figures are inspected here
        figures[path.name] = fig
        return path

    monkeypatch.setattr(report, "save_figure", keep)
    out = tmp_path / "diverged"
    assert cli.run(_args(out, tmp_path / "cache", lrs=[1e-3, 1e6], arms=["control", "gated"])) == 0
    results = {(r["model"], float(r["lr"])): r for r in _read(out / "results.csv")}
    assert [results[m, 1e6]["diverged"] for m in ("control", "gated")] == ["True", "True"]
    assert [results[m, 1e-3]["diverged"] for m in ("control", "gated")] == ["False", "False"]
    sens = {r["model"]: r for r in _read(out / "sensitivity.csv")}
    for m in ("control", "gated"):  # the diverged run counts as the loss before training
        gap = float(sens[m]["initial_loss"]) - float(results[m, 1e-3]["final_loss"])
        assert float(sens[m]["lr_sensitivity"]) == pytest.approx(gap / 2)
    for name, fig in figures.items():
        for line in fig.axes[0].get_lines():
            assert np.isfinite(np.asarray(line.get_ydata(), dtype=float)).all(), (name, line.get_label())
    crosses = [l for l in figures["lr_sweep.png"].axes[0].get_lines() if l.get_marker() == "x"]
    assert [list(l.get_xdata()) for l in crosses] == [[1e6], [1e6]]


def test_stability_flags_reach_the_settings_and_others_are_refused():
    from gated_attention.cli import build_parser

    parse = build_parser().parse_args
    s = settings.stability_settings_from_args(parse(["quickstart", "--preset", "stability", "--lrs", "0.1,0.01",
                                                     "--dtype", "bfloat16", "--arms", "control,qk_norm"]))
    assert (s.lrs, s.dtype, s.arms) == ((0.01, 0.1), "bfloat16", ("control", "qk_norm"))
    for argv, message in ((["--lr", "0.1"], "--lr applies to quickstart's main job"),
                          (["--lrs", "0.1"], "a sweep needs at least two learning rates"),
                          (["--arms", "gated"], "the control first"),
                          (["--arms", "control,rope"], "rope is no arm"),
                          (["--source", "x.gguf"], "--source applies to --preset trained only")):
        with pytest.raises(gated_attention.CLIError, match=message):
            settings.stability_settings_from_args(parse(["quickstart", "--preset", "stability", *argv]))
    with pytest.raises(gated_attention.CLIError, match="--dtype applies to --preset stability only"):
        settings.settings_from_args(parse(["quickstart", "--dtype", "bfloat16"]))
