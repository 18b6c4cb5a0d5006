"""The Bigram-Backcopy task and `gated-attention quickstart --preset backcopy` at smoke size."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gated_attention
from gated_attention.recipes import backcopy, settings
from gated_attention.recipes.backcopy_task import BOS, BackcopyTask, attention_by_query


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- the task


def test_query_split_on_a_hand_made_sequence():
    task = BackcopyTask(n_tokens=4, n_triggers=2)  # 0 BOS, 1..4 ordinary, 5 and 6 triggers
    assert list(task.triggers) == [5, 6] and len(task) == 7
    #                 0  1  2  3  4  5  6  7
    x = torch.tensor([0, 2, 5, 2, 3, 6, 3, 1])
    dormant, active = task.query_kinds(x)
    # query t predicts x[t+1]: after the triggers at 2 and 5 comes the copy of x[1] and x[4]; BOS (query 0) is neither
    assert torch.nonzero(active).ravel().tolist() == [2, 5]
    assert torch.nonzero(dormant).ravel().tolist() == [1, 3, 4, 6, 7]
    both = task.query_kinds(torch.stack([x, x]))  # [B, T] rows alike
    assert torch.equal(both[1][1], active) and torch.equal(both[0][0], dormant)


def test_optimal_loss_by_hand():
    task = BackcopyTask(n_tokens=4, n_triggers=2, successors=2, trigger_prob=0.25)
    p = task.transition()
    x = torch.tensor([[0, 2, 5, 2, 3]])  # queries 0..3 predict 2, 5, 2, 3
    h = [-sum(v * math.log(v) for v in row if v > 0) for row in p]
    choice = -(0.25 * math.log(0.25 / 2) + 0.75 * math.log(0.75))
    by_hand = [math.log(4), choice + 0.75 * h[1], 0.0, choice + 0.75 * h[1]]  # BOS, token 2, trigger, token 2
    assert task.optimal_loss(x) == pytest.approx(sum(by_hand) / 4, rel=1e-12)


def test_sequences_follow_the_rules_and_are_a_function_of_the_seeds():
    task = BackcopyTask(n_tokens=16, n_triggers=3, successors=2, trigger_prob=0.2, seed=3)
    x = task.sample(64, 40, seed=1)
    assert x.shape == (64, 40) and x.dtype == torch.int64
    assert torch.equal(x, task.sample(64, 40, seed=1))  # the same seeds: the same sequences
    assert not torch.equal(x, task.sample(64, 40, seed=2))  # another sample seed
    assert not torch.equal(x, BackcopyTask(n_tokens=16, n_triggers=3, successors=2, trigger_prob=0.2, seed=4).sample(64, 40, 1))
    assert (x[:, 0] == BOS).all() and (x[:, 1:] != BOS).all()
    assert ((x[:, 1] >= 1) & (x[:, 1] <= 16)).all()  # an ordinary token first, so every trigger has one before it
    p = task.transition()
    assert np.allclose(p.sum(axis=1), 1) and ((p > 0).sum(axis=1) == 2).all()
    n_triggers = 0
    for row in x.tolist():
        for t in range(2, len(row)):
            if row[t - 1] > 16:  # after a trigger: the copy of the token before it
                assert row[t] == row[t - 2]
                n_triggers += 1
            elif row[t] <= 16:  # an ordinary token after an ordinary one: one of the chain's successors
                assert p[row[t - 1] - 1, row[t] - 1] > 0
    assert 0.1 < n_triggers / (64 * 38) < 0.25  # about trigger_prob of the ordinary queries


def test_attention_by_query_agrees_with_the_analysis_first_token_attention():
    """`f_attn_all` (all queries t >= 1) is the toolkit's F-Attn; dormant and active split it by query count."""
    from gated_attention.analysis import metrics
    from gated_attention.analysis.capture import Capture

    task = BackcopyTask(n_tokens=8, n_triggers=2, trigger_prob=0.3)
    config = gated_attention.GatedAttentionConfig(vocab_size=len(task), hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2, attn_gate={"position": "G1"})
    torch.manual_seed(0)
    model = gated_attention.GatedAttentionForCausalLM(config)
    rows = task.sample(1, 12, seed=0)
    m = attention_by_query(model, task, rows)
    with Capture(model) as cap:
        model(input_ids=rows)
    maps = [cap.records[-1].attentions[f][0].numpy() for f in (1, 2)]  # [H, T, T]
    expected = metrics.first_token_attention(maps).mean(axis=1)  # [layers]
    dormant, active = task.query_kinds(rows[0])
    for r, a, e in zip(m["layers"], maps, expected):
        assert r["f_attn_all"] == pytest.approx(e, rel=1e-6)  # float64 sums of the same fp32 maps
        on_first = a[:, :, 0].mean(axis=0)
        assert r["f_attn_active"] == pytest.approx(on_first[active.numpy()].mean(), rel=1e-6)
        n_d, n_a = int(dormant.sum()), int(active.sum())
        assert (n_d * r["f_attn_dormant"] + n_a * r["f_attn_active"]) / (n_d + n_a) == pytest.approx(e, rel=1e-6)
    assert 0 < m["gate_mean"] < 1 and m["m_act"] > 0 and sorted(m["maps"]) == [1, 2]


# ---------------------------------------------------------------- the preset


def _args(out: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), smoke=True, threads=1, no_progress=True, preset="backcopy", **extra)


@pytest.mark.slow
def test_backcopy_preset_smoke_end_to_end(tmp_path, capsys):
    from gated_attention.recipes import cli

    out = tmp_path / "backcopy"
    # through quickstart's dispatch, as `gated-attention quickstart --preset backcopy --smoke --compare-gates` runs it
    assert cli.run(_args(out, compare_gates=True)) == 0
    printed = capsys.readouterr().out
    assert "F-Attn dormant" in printed and "control: F-Attn at dormant queries" in printed

    results = _read(out / "results.csv")
    assert [r["model"] for r in results] == ["control", "gated", "low-rank", "truncated", "sinks"]
    sink_share = float(results[-1]["sink_dormant"])  # what the learned sink takes at dormant queries
    assert 0 < sink_share < 1 and all(math.isnan(float(r["sink_dormant"])) for r in results[:-1])
    for column in ("steps", "heldout_loss", "f_attn_dormant", "f_attn_active", "m_act", "first_token_norm_ratio",
                   "gate_mean", "sink_layer", "optimal_loss"):
        assert column in results[0], column
    for r in results:
        assert int(r["steps"]) == settings.BACKCOPY_SMOKE["steps"]
        for column in ("heldout_loss", "f_attn_dormant", "f_attn_active", "m_act", "first_token_norm_ratio"):
            assert math.isfinite(float(r[column])), (r["model"], column)
        assert f"{float(r['heldout_loss']):.4f}" in printed  # the printed table is the CSV
    assert math.isnan(float(results[0]["gate_mean"])) and 0 < float(results[1]["gate_mean"]) < 1
    training = _read(out / "training.csv")
    control = [r["batch"] for r in training if r["model"] == "control"]
    for name in ("gated", "low-rank", "sinks"):
        assert control == [r["batch"] for r in training if r["model"] == name]  # the same batches, step by step
    probes = _read(out / "probes.csv")
    assert sorted({int(r["step"]) for r in probes}) == [0, 3, 6]  # at the start, then every 3 steps
    maps = np.load(out / "attention_maps.npz")
    T = settings.BACKCOPY_SMOKE["seq_len"]
    assert maps["control_layer1"].shape == (1, T, T) and maps["gated_layer1"].shape == (1, T, T)
    assert maps["tokens"].shape == (T,) and maps["tokens"][0] == BOS
    for name in ("attention_maps.png", "sink_trend.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_the_pair_starts_from_the_same_weights():
    s = settings.BackcopySettings(**settings.BACKCOPY_SMOKE)
    control, gated = backcopy.model_arms(s, BackcopyTask(), backcopy.ARMS).values()
    assert control.config.attn_gate["position"] is None and gated.config.attn_gate["position"] == "sdpa"
    g = dict(gated.named_parameters())
    for n, p in control.named_parameters():
        assert torch.equal(p, g[n]), n
    assert all("attn_gate" in n for n in set(g) - set(dict(control.named_parameters())))


def test_compared_gates_start_from_the_controls_weights():
    s = settings.BackcopySettings(**settings.BACKCOPY_SMOKE, compare_gates=True)
    models = backcopy.build_models(s, BackcopyTask(), SimpleNamespace(log=lambda msg: None,
                                                                      placement=SimpleNamespace(device="cpu")))
    assert list(models) == ["control", "gated", "low-rank", "truncated", "sinks"]
    spec = {name: m.config.attn_gate for name, m in models.items()}
    assert (spec["low-rank"]["rank"], spec["truncated"]["input_channels"]) == (2, 2)  # hidden 32 / 16
    assert spec["sinks"]["position"] is None and models["sinks"].config.attention_sinks
    control = dict(models["control"].named_parameters())
    for name, model in models.items():
        params = dict(model.named_parameters())
        assert all(torch.equal(p, params[n]) for n, p in control.items()), name
        assert all("attn_gate" in n or n.endswith(".sinks") for n in set(params) - set(control)), name


def test_backcopy_flags_reach_the_settings_and_others_are_refused():
    from gated_attention import CLIError
    from gated_attention.cli import build_parser

    parse = build_parser().parse_args
    s = settings.backcopy_settings_from_args(parse(["quickstart", "--preset", "backcopy", "--steps", "7", "--lr", "1e-3"]))
    assert (s.steps, s.lr, s.gate_lr, s.weight_decay) == (7, 1e-3, 1e-3, 0.0)  # the gates train at --lr by default
    with pytest.raises(CLIError, match="--vocab-size"):
        settings.backcopy_settings_from_args(parse(["quickstart", "--preset", "backcopy", "--vocab-size", "300"]))
    with pytest.raises(CLIError, match="--corpus"):
        settings.backcopy_settings_from_args(parse(["quickstart", "--preset", "backcopy", "--corpus", "packages"]))
