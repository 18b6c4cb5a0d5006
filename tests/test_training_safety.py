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
    line = _fails(cpt.main, argv, capsys)  # a full disk: one line naming the folder and its free space
    assert line.startswith(f"error: saving final/: the file system of {out} is full ([Errno 28] No space left on "
                           "device), ") and " free; nothing of this save was kept" in line, line
    assert seen and seen[0][0] != "final" and seen[0][1] is False
    assert not (out / "final").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".final")]

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", original)
    cpt.main([*argv, "--overwrite"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "final").iterdir()}


# ---------------------------------------------------------------- checkpoints: whole or absent, checked on resume


def _checkpoint_files(out: Path, step: int) -> dict[str, bytes]:
    folder = out / "checkpoints" / f"step-{step:07d}"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory) -> Path:
    """Four steps with checkpoints after steps 2 and 4, and final/."""
    out = tmp_path_factory.mktemp("finished") / "run"
    import_example("continued_pretraining").main(["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4",
                                                  "--save-every", "2", *COMMON])
    assert _steps(out) == [1, 2, 3, 4]
    return out


def _copy_run(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


DAMAGE = {  # file of the step-4 checkpoint: how it is damaged
    "optimizer.bin": "cut in half",
    "model.safetensors": "cut in half",
    "custom_checkpoint_0.pkl": "cut in half",  # the scheduler
    "random_states_0.pkl": "cut in half",  # accelerate loaded this one without a word
    "step.json": '{"step": ',
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_resume_latest_from_a_damaged_checkpoint_is_one_line_naming_the_file(finished_run, tiny_model, tmp_path,
                                                                            capsys, name):
    """A checkpoint cut short (a full disk, a copy that stopped) was a traceback from inside torch, safetensors
    or json; it is one line naming the file, with the earlier checkpoint to resume from, and exit status 2."""
    out = _copy_run(finished_run, tmp_path)
    path = out / "checkpoints" / "step-0000004" / name
    if DAMAGE[name] == "cut in half":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:
        path.write_text(DAMAGE[name])
    line = _fails(import_example("continued_pretraining").main,
                  ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "6", "--resume", "latest", *COMMON],
                  capsys)
    assert line.startswith(f"error: checkpoint {out / 'checkpoints' / 'step-0000004'}: {name} is damaged: "), line
    assert line.endswith(f"resume from an earlier one: --resume {out / 'checkpoints' / 'step-0000002'}"), line
    assert _steps(out) == [1, 2, 3, 4]


def test_a_step_json_that_names_another_step_is_refused(finished_run, tiny_model, tmp_path, capsys):
    out = _copy_run(finished_run, tmp_path)
    (out / "checkpoints" / "step-0000004" / "step.json").write_text('{"step": 3}')
    line = _fails(import_example("continued_pretraining").main,
                  ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "6", "--resume", "latest", *COMMON],
                  capsys)
    assert "step.json is damaged: it says step 3, and the folder is step-0000004" in line, line


def test_ctrl_c_while_a_resumed_run_saves_an_existing_step_loses_nothing(finished_run, tiny_model, tmp_path, capsys,
                                                                          monkeypatch):
    """Resumed from step 2, the run saves step 4 again: Ctrl-C arrives once accelerate has written the weights
    and the optimizer. The step-4 checkpoint was overwritten in place (a new model.safetensors, a 680-byte
    optimizer.bin beside the old step.json), and `--resume latest` then failed. The save goes to a staging
    folder: step 4 stays as it was, the staging folder goes, the run says which checkpoint is the last complete
    one and exits 130, and the log holds each step once."""
    from accelerate import Accelerator

    out = _copy_run(finished_run, tmp_path)
    before = _checkpoint_files(out, 4)
    original = Accelerator.save_state

    def interrupted_save(self, output_dir=None, **kwargs):
        result = original(self, output_dir, **kwargs)
        if "step-0000004" in str(output_dir):
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(Accelerator, "save_state", interrupted_save)
    cpt = import_example("continued_pretraining")
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4", "--save-every", "2", *COMMON]
    with pytest.raises(SystemExit) as exit_info:
        cpt.main([*argv, "--resume", str(out / "checkpoints" / "step-0000002")])
    assert exit_info.value.code == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]
    latest = out / "checkpoints" / "step-0000004"
    assert err == [f"interrupted; the last complete checkpoint is {latest} (--resume latest continues from it)"], err
    assert _checkpoint_files(out, 4) == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    assert _steps(out) == [1, 2, 3, 4]

    monkeypatch.setattr(Accelerator, "save_state", original)
    cpt.main([*argv, "--steps", "5", "--resume", "latest"])  # continues from the untouched step 4
    assert _steps(out) == [1, 2, 3, 4, 5]


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_keeps_the_earlier_ones(finished_run, tiny_model, tmp_path,
                                                                                       capsys, monkeypatch):
    """safetensors' error for a full disk is no OSError: it is read from its message too."""
    from accelerate import Accelerator

    out = _copy_run(finished_run, tmp_path)
    before = _checkpoint_files(out, 2)
    original = Accelerator.save_state

    def fills(self, output_dir=None, **kwargs):
        original(self, output_dir, **kwargs)
        if "step-0000004" in str(output_dir):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(Accelerator, "save_state", fills)
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4", "--save-every", "2", *COMMON,
            "--resume", str(out / "checkpoints" / "step-0000002")]
    line = _fails(import_example("continued_pretraining").main, argv, capsys)
    assert line.startswith(f"error: saving checkpoint step-0000004: the file system of {out / 'checkpoints'} is full "), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    assert _checkpoint_files(out, 2) == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device every write to fails "
                    "with ENOSPC")
def test_a_disk_that_fills_in_torch_saves_zip_writer_is_one_line_and_a_resume_finishes(tiny_model, tmp_path, capsys,
                                                                                       monkeypatch):
    """On a full file system torch.save's zip writer (what accelerate writes the optimizer with) fails with
    `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos ...`, raised while handling its
    `basic_ios::clear: iostream error`, and no errno: two tracebacks and exit 1. Here the real writer writes
    step 3's optimizer.bin into /dev/full, which fails every write with ENOSPC as a full file system does
    (`--save-every 1` on a small tmpfs fails the same way). One line and exit 2; the checkpoints before stay
    whole, and a resume once there is room finishes."""
    from accelerate import Accelerator

    out = tmp_path / "run"
    original = Accelerator.save_state

    def full(self, output_dir=None, **kwargs):
        if "step-0000003" in str(output_dir):
            (Path(output_dir) / "optimizer.bin").symlink_to("/dev/full")
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", full)
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4", "--save-every", "1", *COMMON]
    cpt = import_example("continued_pretraining")
    line = _fails(cpt.main, argv, capsys)
    assert line.startswith(f"error: saving checkpoint step-0000003: the file system of {out / 'checkpoints'} is full "
                           "(torch.save could not write the whole file: "), line
    assert "unexpected pos" in line and "nothing of this save was kept" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001", "step-0000002"]
    monkeypatch.setattr(Accelerator, "save_state", original)
    cpt.main([*argv, "--resume", "latest"])  # from step 2, saved whole before the disk filled
    assert _steps(out) == [1, 2, 3, 4]


def test_a_disk_that_fills_while_the_log_is_rewritten_is_one_line_and_killed_saves_are_cleared(
        finished_run, tiny_model, tmp_path, capsys, monkeypatch):
    """A resume from step 2 rewrites log.jsonl (its records of steps 3 and 4 are replaced): a full disk there was
    a traceback that left `.log.jsonl.incomplete-PID`. And what saves killed with SIGKILL left (their process
    gone) is removed when the next run starts."""
    out = _copy_run(finished_run, tmp_path)
    dead = 2**22 + 1  # above Linux's largest process id: no process has it
    killed = [out / "checkpoints" / f".step-0000006.incomplete-{dead}", out / f".final.incomplete-{dead}"]
    for folder in killed:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    log = (out / "log.jsonl").read_text()
    replace = os.replace

    def full(src, dst, *args, **kwargs):
        if Path(dst).name == "log.jsonl":
            raise OSError(28, "No space left on device", str(src))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    argv = ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4", *COMMON,
            "--resume", str(out / "checkpoints" / "step-0000002")]
    line = _fails(import_example("continued_pretraining").main, argv, capsys)
    assert line.startswith(f"error: rewriting log.jsonl: the file system of {out} is full "), line
    assert not any(folder.exists() for folder in killed)
    assert (out / "log.jsonl").read_text() == log and not list(out.glob(".log.jsonl*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]


def test_resuming_from_an_earlier_step_replaces_the_log_records_it_trains_again(finished_run, tiny_model, tmp_path):
    """`log.jsonl` held steps 3 and 4 twice after a resume from step 2 into the same folder. The records of the
    steps trained again replace the earlier ones, in step order; the checkpoint of step 4 is replaced whole."""
    out = _copy_run(finished_run, tmp_path)
    first = (out / "log.jsonl").read_text().splitlines()
    import_example("continued_pretraining").main(
        ["--model", str(tiny_model), "--output-dir", str(out), "--steps", "4", "--save-every", "2", *COMMON,
         "--resume", str(out / "checkpoints" / "step-0000002")])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert [r["batch"] for r in log] == [json.loads(line)["batch"] for line in first]  # the same batches again
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]


@pytest.mark.parametrize(("script", "extra"), [("continued_pretraining", []), ("lora_finetune", ["--rank", "2"]),
                                                ("long_context", ["--rope-theta", "50000", "--eval-lengths", "32"])])
def test_ctrl_c_before_any_checkpoint_is_one_line_and_exit_130(tiny_model, tmp_path, capsys, monkeypatch, script,
                                                               extra):
    """Ctrl-C in the first step was a KeyboardInterrupt traceback; it is one line and exit status 130 in every
    training example, and the output folder, still empty, is gone."""
    from accelerate import Accelerator

    def interrupted(self, loss, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Accelerator, "backward", interrupted)
    out = tmp_path / "runs" / "run"
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main(["--model", str(tiny_model), "--output-dir", str(out), "--steps", "2", *COMMON,
                                     *extra])
    assert exit_info.value.code == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]
    assert err == [f"interrupted; no checkpoint is complete yet in {out / 'checkpoints'}"], err
    assert not (tmp_path / "runs").exists()
