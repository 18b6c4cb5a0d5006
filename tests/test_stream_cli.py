"""`gated-attention stream`: its files, its output folder and its one-line refusals, on a tiny model.

The cache itself is checked against StreamingLLM's other form in test_sink_cache.py; here the per-token NLL
the command writes must equal full attention's until the window fills and differ after it.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

import gated_attention as ga
from gated_attention.analysis.stream_cli import STREAM_FILES
from gated_attention.cli import main
from test_analysis_capture import TINY, tiny_tokenizer

WINDOW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "tiny"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 2, "max_position_embeddings": 256})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text(topics["assert"][:600], encoding="utf-8")
    return path


def _stream(model_dir, text_file, out, *extra) -> int:
    return main(["stream", str(model_dir), "--text-file", str(text_file), "--window", str(WINDOW), "--out", str(out),
                 "--max-tokens", "64", *extra])


def test_writes_one_row_per_sink_count_and_the_per_token_nll(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert _stream(model_dir, text_file, out, "--sink-tokens", "0", "4") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(STREAM_FILES)
    with open(out / "stream.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["sink_tokens", "window", "tokens", "ppl"]
        rows = list(reader)
    assert [(int(r["sink_tokens"]), int(r["window"]), int(r["tokens"])) for r in rows] == [(0, WINDOW, 64), (4, WINDOW, 64)]
    data = np.load(out / "stream.npz")
    assert data["input_ids"].shape == (64,)
    for row in rows:
        nll = data[f"nll_sinks_{row['sink_tokens']}"]
        assert nll.shape == (63,) and math.isclose(float(row["ppl"]), math.exp(nll.mean()), rel_tol=1e-5)
        # tokens 1..WINDOW are predicted before anything leaves the cache: full attention's numbers (1e-5: one forward
        # of the window here, chunks there); after that the window differs
        np.testing.assert_allclose(nll[: WINDOW - 1], data["nll_full"][: WINDOW - 1], atol=1e-5, rtol=0)
        assert np.abs(nll[WINDOW:] - data["nll_full"][WINDOW:]).max() > 1e-3
    printed = capsys.readouterr().out
    assert "0 sink tokens: ppl" in printed and "4 sink tokens: ppl" in printed and "full attention: ppl" in printed

    assert _stream(model_dir, text_file, out, "--sink-tokens", "2") == 0  # an earlier output is replaced whole
    assert [r["sink_tokens"] for r in csv.DictReader(open(out / "stream.csv", newline=""))] == ["2"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sink-tokens", str(WINDOW)], f"--sink-tokens {WINDOW} must be below --window {WINDOW}"),
        (["--sink-tokens", "0", "0"], "names a count twice"),
        (["--max-tokens", str(WINDOW + 1)], f"gives {WINDOW + 1} tokens with --max-tokens: a window of {WINDOW} evicts nothing"),
    ],
    ids=["sinks-fill-the-window", "twice", "text-too-short"],
)
def test_bad_input_is_one_line_and_writes_nothing(model_dir, text_file, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["stream", str(model_dir), "--text-file", str(text_file), "--window", str(WINDOW), "--out", str(out),
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar, if it loaded
    assert err.startswith("gated-attention stream: error: ") and message in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_an_out_folder_of_something_else_or_holding_the_text_is_refused(model_dir, text_file, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, message in [(other, "holds 'notes.txt' and is not the output of an earlier stream"),
                         (text_file.parent, "must not be --text-file, inside --text-file or contain it")]:
        capsys.readouterr()
        assert _stream(model_dir, text_file, out) == 2
        assert message in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine" and text_file.exists()


def test_revision_reads_that_snapshot_of_a_cached_hub_id_offline(model_dir, text_file, tmp_path, cached_at_old_commit):
    """`--revision` picks the cache's snapshot of that commit; main's snapshot here holds no model at all."""
    old_commit = cached_at_old_commit(model_dir)

    assert main(["stream", "someone/tiny", "--text-file", str(text_file), "--window", str(WINDOW), "--out",
                 str(tmp_path / "main"), "--max-tokens", "32"]) != 0
    assert main(["stream", "someone/tiny", "--revision", old_commit, "--text-file", str(text_file), "--window",
                 str(WINDOW), "--out", str(tmp_path / "old"), "--max-tokens", "32"]) == 0
    assert (tmp_path / "old" / "stream.csv").is_file()


def _gpt2_dir(tmp_path, positions: int, vocab: int = 300):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("positions", "vocab", "sinks", "message"),
    [
        (48, 300, ["0"], "the text gives 64 tokens, and the model's positions are learned up to 48"),  # was IndexError
        (256, 20, ["0"], "the tokenizer is not this model's"),  # was IndexError
        (256, 300, ["0", "2"], "no rotary position embedding"),  # was refused only after the 0-sink stream ran
    ],
    ids=["past-learned-positions", "foreign-tokenizer", "refused-sinks-first"],
)
def test_a_model_that_cannot_stream_the_text_is_refused_before_any_stream(text_file, tmp_path, capsys, monkeypatch,
                                                                          positions, vocab, sinks, message):
    from gated_attention.analysis import stream

    monkeypatch.setattr(stream, "windowed_nll", lambda *args, **kwargs: pytest.fail("a stream ran before the refusal"))
    out = tmp_path / "out"
    assert _stream(_gpt2_dir(tmp_path, positions, vocab), text_file, out, "--sink-tokens", *sinks) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gated-attention stream: error: ") and message in err, err
    assert not out.exists()


def test_the_help_says_a_token_sees_the_window_and_itself(capsys):
    """W cached entries and the token itself, W + 1 (StreamingLLM's evaluation; `kept` in test_sink_cache.py)."""
    with pytest.raises(SystemExit):
        main(["stream", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--window in all" not in help_text and "the --window entries the cache holds" in help_text
    assert "and to itself" in help_text
