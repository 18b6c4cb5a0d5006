"""Full disks and long names: a DST that does not fit is refused before writing, in
one line naming DST, the bytes needed and those free; a file system that fills up while writing is one line
too, with nothing left behind; no shard is left sparse (a hole read back through mmap on a full tmpfs was a
SIGBUS); and the staging folder's name fits beside any valid DST name."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import pytest

from convert_helpers import make_source, staging_leftovers
from gated_attention.cli import main
from gated_attention.convert import writer
from gated_attention.files import staging


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("llama") / "src")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_dst_that_does_not_fit_is_refused_before_writing(llama, tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    dst = tmp_path / "out"
    assert main(["convert", str(llama), str(dst), "--no-verify"]) == 2
    line = _one_line(capsys)
    needed = sum(p.stat().st_size for p in llama.glob("*.safetensors"))
    assert f"DST {dst}: " in line and "bytes are needed" in line and "has 1,000 free" in line, line
    stated = int(line.split(f"DST {dst}: ")[1].split(" bytes")[0].replace(",", ""))
    assert stated > needed  # SRC's weights, the gates and the other files
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no DST, no staging folder


def test_a_file_system_that_fills_while_writing_is_one_line(llama, tmp_path, capsys, monkeypatch):
    def full(path, tensors, progress=None):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(writer, "write_safetensors", full)
    dst = tmp_path / "deep" / "out"
    assert main(["convert", str(llama), str(dst), "--no-verify"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"gated-attention convert: error: DST {dst}: its file system is full"), line
    assert "No space left on device" in line and "nothing was written" in line, line
    assert not any(tmp_path.iterdir())  # the staging folder and the folders made for DST are gone


def test_no_shard_is_left_sparse(llama, tmp_path):
    """The exact init's zero gate weights were holes: on a full tmpfs, verify's mmap read of them was a SIGBUS."""
    assert main(["convert", str(llama), str(tmp_path / "out"), "--no-verify"]) == 0
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert shards
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY)
        try:
            assert os.lseek(fd, 0, os.SEEK_HOLE) == shard.stat().st_size, f"{shard.name} has a hole"
        finally:
            os.close(fd)


@pytest.mark.parametrize("length", [200, 245, 255])
def test_the_staging_name_fits_beside_any_valid_dst_name(llama, tmp_path, capsys, length):
    """A DST name of 245 characters: `OSError: [Errno 36] File name too long: '.yyy...'` (the staging name passed 255)."""
    dst = tmp_path / ("y" * length)
    assert main(["convert", str(llama), str(dst), "--no-verify"]) == 0
    assert (dst / "config.json").is_file() and staging_leftovers(dst) == []
    # a second run finds a killed run's staging folder by the same (shortened) name, and names it
    stage = staging.staging_path(dst, "incomplete", pid=2**22 + 1)
    assert len(os.fsencode(stage.name)) <= 255
    stage.mkdir()
    dead, running = staging.staging_leftovers(dst)
    assert dead == [stage] and running == []
    capsys.readouterr()
    assert main(["convert", str(llama), str(dst), "--no-verify", "--overwrite"]) == 0
    assert not stage.exists() and (dst / "config.json").is_file()


def test_a_shortened_staging_name_is_its_dst_s_alone():
    """Two long DST names with the same first 240 characters get different staging names."""
    a, b = Path("/x") / ("y" * 240 + "a" * 10), Path("/x") / ("y" * 240 + "b" * 10)
    assert staging.staging_prefix(a, "incomplete") != staging.staging_prefix(b, "incomplete")
    assert staging.staging_prefix(Path("/x/out"), "incomplete") == ".out.incomplete-"
