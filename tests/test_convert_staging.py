"""DST is never lost: a folder that appears at DST while `convert`, `extend` or `export` writes is kept,
and the staging folders a killed run leaves behind are named by the next run (removed by --overwrite).

The races are made deterministic by creating DST from inside the command, right after its weights are
written (between the check at the start and the final rename), plus one real race between processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from convert_helpers import big_source, make_gated, make_source, staging_leftovers
from gated_attention.cli import main
from gated_attention.convert import pipeline

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("llama") / "src")


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    return make_gated(tmp_path_factory.mktemp("gated") / "src")


def _commands(llama: Path, gated: Path, dst: Path) -> dict[str, tuple[list[str], object]]:
    """Each command that stages a folder, and the module whose `write_sharded` it calls (one pipeline for all)."""
    return {
        "convert": (["convert", str(llama), str(dst), "--no-verify"], pipeline),
        "extend": (["extend", str(gated), str(dst), "--rope-theta", "2e4", "--no-verify"], pipeline),
        "export": (["export", str(gated), str(dst), "--format", "qwen3_5", "--no-verify"], pipeline),
    }


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
@pytest.mark.parametrize("made", ["empty folder", "folder with a file", "file"])
def test_a_dst_made_while_writing_is_kept(llama, gated, tmp_path, capsys, monkeypatch, command, made):
    """Without --overwrite the result goes into place only if nothing is at DST at that moment. An empty
    folder counts: rename(2) would silently replace it, and its owner may be about to write into it."""
    dst = tmp_path / "race"
    argv, module = _commands(llama, gated, dst)[command]
    write_sharded = module.write_sharded

    def write_then_someone_makes_dst(*args, **kwargs):
        shards = write_sharded(*args, **kwargs)
        if made == "file":
            dst.write_text("x")
        else:
            dst.mkdir()
            if made == "folder with a file":
                (dst / "keep.txt").write_text("x")
        return shards

    monkeypatch.setattr(module, "write_sharded", write_then_someone_makes_dst)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"gated-attention {command}: error: ") and "appeared while" in err, err
    if made == "file":
        assert dst.read_text() == "x"
    else:
        assert sorted(p.name for p in dst.iterdir()) == (["keep.txt"] if made == "folder with a file" else [])
    assert staging_leftovers(dst) == []


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
def test_overwrite_replaces_dst_and_leaves_nothing_beside_it(llama, gated, tmp_path, command):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").write_text('{"model_type": "old"}')  # an earlier result: --overwrite replaces only those
    (dst / "old.safetensors").write_text("old")
    argv, _ = _commands(llama, gated, dst)[command]
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((dst / "config.json").read_text())["model_type"] != "old"
    assert not (dst / "old.safetensors").exists()
    assert staging_leftovers(dst) == []


def test_the_portable_fallback_keeps_an_empty_dst_too(tmp_path, monkeypatch):
    """Where renameat2(RENAME_NOREPLACE) is missing (not Linux, old libc, a file system without it)."""
    from gated_attention.files import staging

    monkeypatch.setattr(staging, "renameat2", lambda src, dst, flags: False)
    stage, dst = tmp_path / "stage", tmp_path / "dst"
    stage.mkdir()
    (stage / "model.safetensors").write_text("new")
    dst.mkdir()
    with pytest.raises(FileExistsError):
        staging.rename_noreplace(stage, dst)
    assert list(dst.iterdir()) == [] and (stage / "model.safetensors").is_file()

    dst.rmdir()
    staging.rename_noreplace(stage, dst)
    assert (dst / "model.safetensors").read_text() == "new" and not stage.exists()


def test_renameat2_is_used_on_linux(tmp_path):
    from gated_attention.files import staging

    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with pytest.raises(FileExistsError):  # an empty b: plain rename(2) would have replaced it
        staging.renameat2(a, b, staging.RENAME_NOREPLACE)
    assert a.is_dir() and b.is_dir()


def test_a_real_race_between_processes(tmp_path):
    """The bug as reported: `convert SRC DST & ...; mkdir DST; echo x > DST/keep.txt; wait` lost keep.txt."""
    src = big_source(tmp_path / "big")
    dst = tmp_path / "race"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gated_attention", "convert", str(src), str(dst)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    # The weights are written and renaming waits for the verification, which loads two models: seconds.
    for line in proc.stdout:
        if line.startswith("verifying"):
            break
    else:
        pytest.fail(f"convert ended before verifying: {proc.communicate()}")
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (out, err)
    assert "appeared while" in err.strip().splitlines()[-1]
    assert (dst / "keep.txt").read_text() == "x" and sorted(os.listdir(dst)) == ["keep.txt"]
    assert staging_leftovers(dst) == []


# --- leftovers of a killed run ---------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leftover(dst: Path, kind: str, pid: int) -> Path:
    folder = dst.parent / f".{dst.name}.{kind}-{pid}"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"half")
    return folder


def test_a_killed_runs_leftovers_are_named_then_removed_by_overwrite(llama, tmp_path, capsys):
    dst = tmp_path / "out"
    incomplete = _leftover(dst, "incomplete", _dead_pid())
    replaced = _leftover(dst, "replaced", _dead_pid())
    capsys.readouterr()
    assert main(["convert", str(llama), str(dst), "--no-verify"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("gated-attention convert: warning: ")
    assert incomplete.name in warnings[0] and replaced.name in warnings[0] and "--overwrite" in warnings[0]
    assert incomplete.is_dir() and replaced.is_dir()  # named, not removed

    assert main(["convert", str(llama), str(dst), "--no-verify", "--overwrite"]) == 0
    assert not incomplete.exists() and not replaced.exists()
    assert staging_leftovers(dst) == []


def test_overwrite_leaves_the_folder_of_a_running_conversion_alone(llama, tmp_path, capsys):
    dst = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        running = _leftover(dst, "incomplete", sleeper.pid)
        capsys.readouterr()
        assert main(["convert", str(llama), str(dst), "--no-verify", "--overwrite"]) == 0
        err = capsys.readouterr().err
        assert running.is_dir()
        assert f"process {sleeper.pid}" in err and "running" in err, err
    finally:
        sleeper.kill()
        sleeper.wait()
    shutil.rmtree(running)


def test_leftovers_are_found_beside_a_dst_whose_name_has_glob_characters(tmp_path):
    from gated_attention.files import staging

    dst = tmp_path / "run[1]"
    left = _leftover(dst, "incomplete", _dead_pid())
    _leftover(tmp_path / "run1", "incomplete", _dead_pid())  # what the unescaped pattern would also match
    assert staging.staging_leftovers(dst) == ([left], [])
