"""The package corpus and `gated-attention quickstart --preset sinks` (the sink search's recipe) at smoke size."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import gated_attention
from gated_attention.recipes import settings, sinks
from gated_attention.recipes.common import Job, Placement, model_pair
from gated_attention.training import data

CORPUS_CHARS = 300_000  # a prefix of the package corpus: tokenized in well under a second


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- corpus


def test_package_corpus_is_fixed_split_and_capped_by_prefix():
    full = data.package_corpus_documents(max_chars=None)
    names = [d.name for d in full]
    assert len(set(names)) == len(names)
    # names are relative to the package / stdlib folder, never the install location
    assert all(n.startswith(("pydoc:", "stdlib:", "pkg:")) for n in names)
    assert not any("site-packages" in n or n.startswith("/") for n in names)
    assert any(n.startswith("pkg:torch/") for n in names) and any(n.startswith("pkg:transformers/") for n in names)
    capped = data.package_corpus_documents(max_chars=CORPUS_CHARS)
    assert [d.name for d in capped] == names[: len(capped)]  # the cap keeps a prefix of the fixed order
    assert sum(len(d.text) for d in capped) <= CORPUS_CHARS or len(capped) == 1

    train = data.documents("packages", "train", CORPUS_CHARS)
    valid = data.documents("packages", "validation", CORPUS_CHARS)
    assert {d.name for d in train} | {d.name for d in valid} == {d.name for d in capped}
    assert not {d.name for d in train} & {d.name for d in valid}
    assert data.corpus_fingerprint(valid) == data.corpus_fingerprint(data.documents("packages", "validation", CORPUS_CHARS))
    # the same name goes to the same split in both corpora, so the embedded tokenizer never saw a validation document
    embedded_valid = {d.name for d in data.corpus_split("validation")}
    assert not embedded_valid & {d.name for d in data.documents("packages", "train", None)}


def test_package_corpus_tokens_are_cached_with_their_size(tmp_path):
    tok = data.load_tokenizer(300, 150_000, tmp_path)
    stream = data.corpus_tokens(tok, "validation", CORPUS_CHARS, corpus="packages")
    fingerprint = data.corpus_fingerprint(data.documents("packages", "validation", CORPUS_CHARS))
    cached = Path(tok.name_or_path) / f"tokens-validation-{fingerprint}.npy"
    assert np.array_equal(np.load(cached), stream)
    info = (cached.with_suffix(".json")).read_text()
    assert f'"tokens": {len(stream)}' in info and '"torch"' in info  # size and package versions recorded
    with pytest.raises(ValueError, match="corpus must be one of"):
        data.documents("web", "train")


# ---------------------------------------------------------------- metrics


def test_uniform_first_token_attention_by_hand():
    from gated_attention.recipes.report import uniform_first_token_attention

    # T = 3: queries 1 and 2 put 1/2 and 1/3 on token 0
    assert uniform_first_token_attention(3) == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_layer_metrics_split_the_max_between_first_and_other_tokens():
    config = gated_attention.GatedAttentionConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        attn_gate={"position": "G1"},
    )
    torch.manual_seed(0)
    rows = sinks.layer_metrics(gated_attention.GatedAttentionForCausalLM(config), torch.randint(0, 64, (2, 7)))
    assert [r["layer"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 < r["f_attn"] < 1 and 0 < r["gate_mean"] < 1
        # per sequence, max |x| over all tokens is the larger of the two parts; the mean keeps the bound
        assert r["m_act"] >= max(r["first_token_max"], r["other_tokens_max"]) - 1e-6
        assert r["m_act"] <= r["first_token_max"] + r["other_tokens_max"] + 1e-6


# ---------------------------------------------------------------- the preset


def _args(out: Path, cache: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), cache=str(cache), smoke=True, threads=1, no_progress=True,
                              preset="sinks", **extra)


@pytest.mark.slow
def test_sinks_preset_smoke_end_to_end(tmp_path, capsys):
    from gated_attention.recipes import cli

    out = tmp_path / "sinks"
    # through quickstart's dispatch, as `gated-attention quickstart --preset sinks --smoke` runs it
    assert cli.run(_args(out, tmp_path / "cache")) == 0
    printed = capsys.readouterr().out
    assert "F-Attn" in printed and "max|x| tok 0" in printed and "uniform causal attention" in printed

    layers = _read(out / "layers.csv")
    assert [(r["model"], r["layer"]) for r in layers] == [("no gate", "1"), ("no gate", "2"), ("G1 gate", "1"), ("G1 gate", "2")]
    for r in layers:
        gated = r["model"] == "G1 gate"
        assert math.isfinite(float(r["f_attn"])) and math.isfinite(float(r["val_ppl"]))
        assert (0 < float(r["gate_mean"]) < 1) if gated else math.isnan(float(r["gate_mean"]))
    # the printed table is the CSV: every row's F-Attn appears, formatted as printed
    for r in layers:
        assert f"{float(r['f_attn']):.3f}" in printed
    training = _read(out / "training.csv")
    ungated = [r["batch"] for r in training if r["model"] == "no gate"]
    assert ungated == [r["batch"] for r in training if r["model"] == "G1 gate"]  # the same batches, step by step
    assert len(ungated) == settings.SINKS_SMOKE["steps"]
    probes = _read(out / "probes.csv")
    assert sorted({int(r["step"]) for r in probes}) == [2, 4]  # probed every 2 steps, chunked training
    assert "fingerprint" in (out / "corpus.json").read_text()
    for name in ("first_token_attention.png", "max_activation.png", "sink_trend.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_chunked_training_equals_one_run(tmp_path):
    """Probing between chunks must not change training: same weights as an unprobed run."""
    s = settings.SinkSettings(**{**settings.SINKS_SMOKE, "steps": 4})
    tok = data.load_tokenizer(s.vocab_size, s.tokenizer_chars, tmp_path)
    rows = data.pack(data.corpus_tokens(tok, "train", s.corpus_chars, corpus=s.corpus), s.seq_len, tok.bos_token_id)
    probe = rows[:1]
    job = Job(tmp_path, tmp_path, tmp_path, Placement(torch.device("cpu"), None), progress=False)
    chunked, _ = model_pair(s, tok)
    whole, _ = model_pair(s, tok)
    sinks.train_model(chunked, "a", s, rows, probe, job)
    sinks.train_model(whole, "b", settings.SinkSettings(**{**settings.SINKS_SMOKE, "steps": 4, "probe_every": 0}),
                      rows, probe, job)
    for (n, p), q in zip(chunked.named_parameters(), whole.parameters()):
        assert torch.equal(p, q), n


@pytest.fixture
def bars(monkeypatch) -> list:
    """Every progress bar `train` and `train_with_probes` open, each with `closed` set when it is closed."""
    import tqdm.auto

    from gated_attention.recipes import common

    opened = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            self.closed = False
            super().__init__(*args, **kwargs)
            opened.append(self)

        def close(self):
            self.closed = True
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)  # `train` imports it when it runs
    monkeypatch.setattr(common, "tqdm", Recorded)
    return opened


def _tiny_gated():
    torch.manual_seed(0)
    config = gated_attention.GatedAttentionConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=1, num_attention_heads=2, attn_gate={"position": "G1"})
    return gated_attention.GatedAttentionForCausalLM(config)


def test_train_closes_its_progress_bar_when_the_loss_is_not_finite(bars):
    from gated_attention.training import TrainConfig, make_optimizer, make_scheduler, train

    model = _tiny_gated()
    torch.nn.init.constant_(model.lm_head.weight, math.nan)
    config = TrainConfig(steps=3, batch_size=2, lr=1e-3, gate_lr=1e-3)
    optimizer = make_optimizer(model, config.lr, config.gate_lr)
    try:
        train(model, torch.randint(0, 40, (4, 6)), config, optimizer, make_scheduler(optimizer, 3, 0))
    except FloatingPointError as e:
        assert str(e) == "loss became nan at step 1"
        # Checked while the traceback still holds the bar: once it is freed, tqdm's __del__ would close it anyway.
        assert [bar.closed for bar in bars] == [True]
    else:
        pytest.fail("a NaN loss did not raise")


def test_train_with_probes_calls_the_probe_where_asked_and_trains_gates_alone_first(tmp_path, bars):
    """The shared loop of the presets: probes at 0 (asked), every 2 steps and at the last; with `gates_first` only
    the gate parameters move in the first steps, and the chunk boundary there changes nothing else. The four chunks
    (to steps 2, 3, 4 and 5) show one progress bar, over all five steps."""
    from gated_attention.recipes.common import train_with_probes
    from gated_attention.training import TrainConfig

    model = _tiny_gated()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = torch.randint(0, 40, (8, 6))
    job = Job(tmp_path, tmp_path, tmp_path, Placement(torch.device("cpu"), None), progress=True)
    seen = []

    def probe(step, loss, minutes):
        seen.append(step)
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
        return [{"moved_other": any("attn_gate" not in n for n in moved), "moved_gate": any("attn_gate" in n for n in moved)}]

    trained = train_with_probes(model, "m", rows, TrainConfig(steps=5, batch_size=2, lr=1e-2, gate_lr=1e-2), job, probe,
                                every=2, at_start=True, gates_first=3)
    assert seen == [0, 2, 4, 5] and [p["step"] for p in trained.probes] == seen and len(trained.history) == 5
    by_step = {p["step"]: p for p in trained.probes}
    assert math.isnan(by_step[0]["loss"]) and by_step[5]["loss"] == trained.history[-1]["loss"]
    assert (by_step[2]["moved_gate"], by_step[2]["moved_other"]) == (True, False)  # the gates alone until step 3
    assert by_step[4]["moved_other"] and all(p.requires_grad for p in model.parameters())
    assert [(bar.total, bar.n, bar.closed) for bar in bars] == [(5, 5, True)]


@pytest.mark.slow
def test_sinks_preset_hybrid_smoke_runs_analyze_on_both(tmp_path):
    from gated_attention.recipes import cli

    out = tmp_path / "hybrid"
    assert cli.run(_args(out, tmp_path / "cache", architecture="hybrid")) == 0
    layers = _read(out / "layers.csv")
    # 3:1 at smoke size: GDN, GDN, full attention; F-Attn exists only for the attention layer
    assert [r["f_attn"] == "nan" for r in layers if r["model"] == "no gate"] == [True, True, False]
    analyzed = _read(out / "analyze.csv")
    for model in ("no_gate", "G1_gate"):
        rows = {(r["metric"], r["anchor"]): r for r in analyzed if r["model"] == model}
        for key in (("sink_spike_alignment", "consensus_sink"), ("peak_excess", "consensus_sink")):
            assert math.isfinite(float(rows[key]["mean"])) and rows[key]["ci_low"] != "", (model, key)
        assert (out / "analyze" / model / "summary.md").exists()
        assert (out / "models" / model / "config.json").exists()


def test_cli_spells_out_the_corpora_of_the_data_module():
    """The quickstart parser lists the corpora without importing `data` (torch): the two lists must agree."""
    from gated_attention.cli import build_parser
    from gated_attention.recipes.settings import CORPORA

    assert CORPORA == data.CORPORA
    args = build_parser().parse_args(["quickstart", "--preset", "sinks", "--corpus", "packages", "--architecture", "hybrid"])
    assert (args.preset, args.corpus, args.architecture) == ("sinks", "packages", "hybrid")


def test_preset_flags_reach_the_settings():
    from gated_attention.cli import build_parser

    args = build_parser().parse_args(["quickstart", "--preset", "sinks", "--layers", "12", "--weight-decay", "1.0"])
    s = settings.sink_settings_from_args(args)
    assert (s.num_hidden_layers, s.weight_decay) == (12, 1.0)
    assert settings.sink_settings_from_args(build_parser().parse_args(["quickstart", "--preset", "sinks"])).weight_decay == 0.1
