"""`--overwrite` (and every output folder) replaces only what the package writes.

The output folder, resolved, may not be the working folder or above it, nor an input; a non-empty one that
is not the package's own (a checkpoint for convert/extend/export, an earlier analysis for analyze, an
earlier run for the examples) is refused in one line naming a file it holds, and nothing is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from convert_helpers import make_gated, make_source
from gated_attention.cli import main
from example_helpers import import_example



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("llama") / "src")


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    return make_gated(tmp_path_factory.mktemp("gated") / "src")


def _argv(command: str, llama: Path, gated: Path, dst) -> list[str]:
    return {
        "convert": ["convert", str(llama), str(dst), "--no-verify", "--overwrite"],
        "extend": ["extend", str(gated), str(dst), "--rope-theta", "2e4", "--no-verify", "--overwrite"],
        "export": ["export", str(gated), str(dst), "--format", "qwen3_5", "--no-verify", "--overwrite"],
    }[command]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(argv, capsys, expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    return err[0]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """The working folder sandbox/inner, holding a user's file."""
    inner = tmp_path / "sandbox" / "inner"
    inner.mkdir(parents=True)
    (inner / "notes.txt").write_text("mine")
    monkeypatch.chdir(inner)
    return inner


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
@pytest.mark.parametrize("spelling", ["absolute", "above", "symlink", "dotdot"])
def test_overwrite_never_replaces_the_working_folder(llama, gated, sandbox, capsys, command, spelling):
    """`.` and `..` were refused, the other spellings of the working folder were replaced, files and all."""
    link = sandbox.parent / "link"
    link.symlink_to(sandbox, target_is_directory=True)
    dst = {"absolute": sandbox, "above": sandbox.parent, "symlink": link, "dotdot": Path("..") / sandbox.name}[spelling]
    before = _snapshot(sandbox.parent)
    _refused(_argv(command, llama, gated, dst), capsys, "working folder")
    assert _snapshot(sandbox.parent) == before and link.is_symlink()


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
def test_overwrite_refuses_a_folder_that_is_no_checkpoint_naming_a_file(llama, gated, tmp_path, capsys, command):
    dst = tmp_path / "userstuff"
    (dst / "figures").mkdir(parents=True)
    (dst / "thesis.tex").write_text("\\begin{document}")
    line = _refused(_argv(command, llama, gated, dst), capsys, "'thesis.tex'")
    assert "not a model checkpoint" in line
    assert (dst / "thesis.tex").read_text() == "\\begin{document}" and (dst / "figures").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userstuff"]  # no staging folder either


@pytest.mark.parametrize("command", ["convert", "extend", "export"])
def test_overwrite_refuses_a_file_at_dst(llama, gated, tmp_path, capsys, command):
    dst = tmp_path / "notes.txt"
    dst.write_text("mine")
    _refused(_argv(command, llama, gated, dst), capsys, "is a file, not a folder")
    assert dst.read_text() == "mine"


def test_overwrite_replaces_a_checkpoint(llama, gated, tmp_path, capsys):
    """What the package writes it may replace: an earlier result (its config.json names a model_type)."""
    dst = tmp_path / "out"
    assert main(_argv("extend", llama, gated, dst)) == 0
    assert main(_argv("extend", llama, gated, dst)) == 0
    assert (dst / "config.json").is_file()


# ---------------------------------------------------------------- analyze --out


@pytest.mark.parametrize("case", ["working folder", "user folder", "model folder"])
def test_analyze_out_is_refused_before_loading(gated, sandbox, capsys, case):
    user = sandbox.parent / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("x")
    out, expected = {
        "working folder": (sandbox, "working folder"),
        "user folder": (user, "'thesis.tex'"),
        "model folder": (gated, "must not be MODEL, inside MODEL or contain it"),
    }[case]
    before = {**_snapshot(sandbox.parent), **_snapshot(gated)}
    _refused(["analyze", str(gated), "--out", str(out), "--bootstrap", "1", "--n-per-domain", "1"], capsys, expected)
    assert {**_snapshot(sandbox.parent), **_snapshot(gated)} == before


# ---------------------------------------------------------------- the examples' --output-dir


@pytest.mark.parametrize("case", ["working folder", "user folder", "a file", "model folder"])
@pytest.mark.parametrize("script", ["continued_pretraining", "lora_finetune", "long_context"])
def test_an_examples_output_dir_is_refused_before_loading(gated, sandbox, capsys, script, case):
    user = sandbox.parent / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("x")
    (sandbox.parent / "afile").write_text("x")
    out, expected = {
        "working folder": (sandbox, "working folder"),
        "user folder": (user, "'thesis.tex'"),
        "a file": (sandbox.parent / "afile", "is a file, not a folder"),
        "model folder": (gated / "runs", "must not be --model, inside --model or contain it"),
    }[case]
    extra = ["--rope-theta", "50000"] if script == "long_context" else []
    before = {**_snapshot(sandbox.parent), **_snapshot(gated)}
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main(["--model", str(gated), "--output-dir", str(out), "--steps", "1", "--seq-len", "16",
                               *extra])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: --output-dir") and expected in err[0], err
    assert {**_snapshot(sandbox.parent), **_snapshot(gated)} == before
    assert not os.path.lexists(gated / "runs")
