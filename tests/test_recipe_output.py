"""quickstart's `--out`: a finished run is replaced whole or not at all, never mixed (`recipes.folders`).

Every recipe writes through `common.Job.start`; the backcopy preset at smoke size (seconds) stands for all of
them. Stopped runs are simulated where that is exact (Ctrl-C is a KeyboardInterrupt raised inside the run) and
real where it is not (SIGKILL, which no handler sees).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gated_attention
from gated_attention.recipes import backcopy, cli


def _args(out: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(out=str(out), smoke=True, threads=1, no_progress=True, preset="backcopy", **extra)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished backcopy run (seed 0), and a file of the user's beside it that nothing may touch."""
    root = tmp_path_factory.mktemp("runs")
    (root / "notes.txt").write_text("mine")
    assert cli.run(_args(root / "out", seed=0)) == 0
    return root / "out"


@pytest.mark.slow
def test_an_interrupted_rerun_leaves_the_finished_run_as_it_was(finished, monkeypatch):
    before = _snapshot(finished)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C after both models trained: the new settings.json had been written

    monkeypatch.setattr(backcopy, "measure", stopped)
    with pytest.raises(KeyboardInterrupt):
        cli.run(_args(finished, seed=1))
    assert _snapshot(finished) == before
    assert json.loads((finished / "settings.json").read_text())["seed"] == 0
    assert _beside(finished) == ["notes.txt"]  # no staging folder left


@pytest.mark.slow
def test_a_killed_rerun_leaves_the_finished_run_and_the_next_run_replaces_it_whole(finished, tmp_path):
    before = _snapshot(finished)
    env = {**os.environ, "PYTHONPATH": str(Path(gated_attention.__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "gated_attention", "quickstart", "--preset", "backcopy", "--smoke",
                             "--seed", "1", "--threads", "1", "--no-progress", "--out", str(finished)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = finished.parent / f".out.incomplete-{proc.pid}"
    deadline = time.monotonic() + 120
    while not (staging / "settings.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # still running, its settings.json written
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _snapshot(finished) == before and staging.is_dir()  # what SIGKILL leaves: the staging folder only

    (finished / "extra.txt").write_text("left by the first run")
    assert cli.run(_args(finished, seed=1)) == 0  # removes the killed run's staging folder, replaces out whole
    assert json.loads((finished / "settings.json").read_text())["seed"] == 1
    assert not (finished / "extra.txt").exists()
    assert _beside(finished) == ["notes.txt"]


def test_a_second_run_on_the_same_out_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".out.incomplete-{first.pid}").mkdir()  # what a running recipe has beside its --out
        with pytest.raises(gated_attention.CLIError, match=f"--out {out} is being written by another run .process {first.pid}"):
            cli.run(_args(out))
    finally:
        first.kill()
        first.wait()
    assert not out.exists()


@pytest.mark.parametrize("case", ["user folder", "cache inside", "a file"])
def test_an_out_that_is_not_a_recipes_own_is_refused_before_anything_is_written(tmp_path, case):
    out = tmp_path / "out"
    if case == "user folder":
        out.mkdir()
        (out / "thesis.tex").write_text("mine")
        extra, message = {}, "holds 'thesis.tex' and is not an earlier quickstart's output"
    elif case == "cache inside":
        (out / "cache").mkdir(parents=True)
        extra, message = {"cache": str(out / "cache")}, "must not be --cache, inside --cache or contain it"
    else:
        out.write_text("a file")
        extra, message = {}, "is a file, not a folder"
    before = _snapshot(tmp_path)
    with pytest.raises(gated_attention.CLIError, match=message):
        cli.run(_args(out, **extra))
    assert _snapshot(tmp_path) == before
