"""Training loses nothing and saves no broken model.

- A run whose weights stop being finite exits non-zero in one line naming the step, and writes no `final/`
  (nor a checkpoint of those weights).
- A rerun into an `--output-dir` that holds a run is refused unless `--resume latest` or `--overwrite`.
- `final/` is written into a staging folder beside it and renamed when whole: a save that dies halfway
  leaves no `final/` that looks complete.

One process, a tiny gated model, one or two steps of 16-token rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import gated_attention
from example_helpers import import_example, save_tiny_model

MAX_CHARS = 150_000
COMMON = ["--seq-len", "16", "--batch-size", "2", "--max-chars", str(MAX_CHARS), "--eval-sequences", "2",
          "--log-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("GATED_ATTENTION_CACHE")
    os.environ["GATED_ATTENTION_CACHE"] = str(cache)
    yield save_tiny_model(tmp_path_factory.mktemp("tiny"), MAX_CHARS, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, max_position_embeddings=32)
    if old is None:
        os.environ.pop("GATED_ATTENTION_CACHE")
    else:
        os.environ["GATED_ATTENTION_CACHE"] = old


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def _fails(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if "error" in line.lower() or "Traceback" in line]  # not the progress bars
    assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("error: "), err
    return errors[0]


def test_a_diverged_run_saves_no_final_and_exits_non_zero(tiny_model, tmp_path, capsys):
    """--lr 1e30 --steps 2 printed `validation: loss nan`, `saved .../final`, exit 0, every tensor NaN."""
    out = tmp_path / "run"
    line = _fails(import_example("continued_pretraining").main,
                  ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "2", "--lr", "1e30",
                   "--gate-lr", "1e30", "--max-grad-norm", "0", *COMMON], capsys)
    assert "step" in line and ("not finite" in line or "loss became" in line), line
    assert not (out / "final").exists()
    assert not list(out.glob("checkpoints/*/step.json")), "a checkpoint of non-finite weights was saved"


def test_save_final_refuses_non_finite_weights(tiny_model, tmp_path):
    from accelerate import Accelerator

    from gated_attention.training import save_final

    model = gated_attention.GatedAttentionForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(FloatingPointError, match="not finite.*step 7"):
        save_final(Accelerator(cpu=True), model, tmp_path / "final", step=7)
    assert not any(tmp_path.iterdir())


def test_a_rerun_into_a_finished_run_is_refused_unless_resume_or_overwrite(tiny_model, tmp_path, capsys):
    cpt = import_example("continued_pretraining")
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "1", *COMMON]
    cpt.main(argv)
    assert _steps(out) == [1]
    final = (out / "final" / "model.safetensors").read_bytes()

    line = _fails(cpt.main, argv, capsys)
    assert line.startswith(f"error: --output-dir {out} already holds a run") and "--resume latest" in line, line
    assert _steps(out) == [1] and (out / "final" / "model.safetensors").read_bytes() == final

    line = _fails(cpt.main, [*argv, "--overwrite", "--resume", "latest"], capsys)
    assert "--overwrite" in line and "--resume" in line, line

    cpt.main([*argv, "--resume", "latest"])  # nothing left to train: the run is finished
    assert _steps(out) == [1]
    (out / "notes.txt").write_text("mine")
    cpt.main([*argv, "--overwrite", "--seed", "1"])  # the run is replaced, not appended to
    assert _steps(out) == [1] and (out / "notes.txt").read_text() == "mine"
    assert (out / "final" / "model.safetensors").read_bytes() != final


def test_final_appears_only_when_whole(tiny_model, tmp_path, capsys, monkeypatch):
    """A save that dies after the weights (here: in the tokenizer's save) leaves no `final/`; the next run
    with --overwrite writes it whole."""
    cpt = import_example("continued_pretraining")
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "1", *COMMON]
    seen = []

    from transformers import PreTrainedTokenizerBase

    original = PreTrainedTokenizerBase.save_pretrained

    def dies(self, folder, *args, **kwargs):
        seen.append((Path(folder).name, (out / "final").exists()))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", dies)
    with pytest.raises(OSError, match="No space left"):
        cpt.main(argv)
    assert seen and seen[0][0] != "final" and seen[0][1] is False
    assert not (out / "final").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".final")]

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", original)
    cpt.main([*argv, "--overwrite"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "final").iterdir()}
