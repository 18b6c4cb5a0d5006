"""`gated-attention analyze` under bad input: inputs past the model's context, and a Hub that cannot be reached.

The Hub is made unreachable by pointing huggingface_hub at a closed local port (HF_ENDPOINT), so these
tests never touch the network and behave the same on a machine that has one.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gated_attention as ga
from gated_attention.cli import main
from test_analysis_capture import TINY, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 16  # the tiny model's max_position_embeddings; the built-in samples are far longer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "tiny"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 2, "max_position_embeddings": CONTEXT})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _n_tokens(out: Path) -> list[int]:
    with open(out / "inputs.csv", newline="") as f:
        return [int(row["n_tokens"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("max_length", [None, 1000], ids=["default-128", "1000"])
def test_inputs_past_the_models_context_are_cut_there_with_a_warning(model_dir, tmp_path, capsys, max_length):
    out = tmp_path / "out"
    argv = ["analyze", str(model_dir), "--out", str(out), "--n-per-domain", "1", "--bootstrap", "10"]
    capsys.readouterr()
    assert main(argv + (["--max-length", str(max_length)] if max_length else [])) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("gated-attention analyze: warning: 3 of 3 inputs are longer than the model's context")
    assert f"max_position_embeddings {CONTEXT}" in warnings[0] and f"cut to {CONTEXT} tokens" in warnings[0]
    assert _n_tokens(out) == [CONTEXT] * 3


def test_inputs_within_the_context_get_no_warning(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["analyze", str(model_dir), "--out", str(out), "--n-per-domain", "1", "--bootstrap", "10",
                 "--max-length", "12"]) == 0  # fmt: skip
    assert "warning" not in capsys.readouterr().err
    assert _n_tokens(out) == [12] * 3


def _offline_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}  # port 9 (discard): refused


def _analyze(model: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gated_attention", "analyze", model, "--out", str(out), "--n-per-domain", "1",
         "--max-length", "12", "--bootstrap", "10"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_hub_id_that_is_not_cached_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    # huggingface_hub retries each file five times (1+2+4+8+8 s) when the Hub does not answer: 22 lines, a minute.
    proc = _analyze("someorg/not-cached", tmp_path / "out", _offline_env(tmp_path / "cache"))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gated-attention analyze: error: cannot load model 'someorg/not-cached'")
    assert "not in the Hugging Face cache" in err and "cannot be reached" in err
    assert not (tmp_path / "out").exists()


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(model_dir, tmp_path):
    # The cache layout huggingface_hub writes: refs/main names the snapshot, the snapshot holds the files.
    commit = "0" * 40
    repo = tmp_path / "cache" / "models--someorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    proc = _analyze("someorg/tiny", tmp_path / "out", _offline_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    assert "Retrying" not in proc.stderr
    assert _n_tokens(tmp_path / "out") == [12] * 3


def test_a_failed_analysis_leaves_no_empty_out_folder(tmp_path, capsys):
    # A one-position model: every input is cut to one token, which has no next token and no later query.
    folder = tmp_path / "model"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 1, "max_position_embeddings": 1})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "new" / "out"
    capsys.readouterr()
    assert main(["analyze", str(folder), "--out", str(out), "--n-per-domain", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "gated-attention analyze: error: no input has at least two tokens"
    assert not (tmp_path / "new").exists()
