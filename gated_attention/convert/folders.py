"""SRC and DST of `convert`, `extend` and `export` on disk: the checks that need no file content, and the
staging folder that DST appears from, whole or not at all. DST is never lost.

Everything is written into a hidden folder beside DST (`.DST.incomplete-PID`; for a DST name too long to
take the additions, a head of it and its hash: `staging_prefix`),
which is renamed to DST only when complete, so a DST that exists is always a
whole checkpoint. Ctrl-C and SIGTERM remove the staging folder; after a
SIGKILL it stays behind, marked incomplete by its name, and the next run names
it (`--overwrite` removes it).

The final rename never replaces what is at DST at that moment, unless asked
to (`overwrite`): DST is checked when the command starts, but a folder may be
made there while the weights are written (minutes), and plain rename(2)
silently replaces an empty folder, which its owner may be about to fill. On
Linux, renameat2(RENAME_NOREPLACE) makes the check and the rename one atomic
step; elsewhere DST is claimed with mkdir first (see `rename_noreplace`).

Standard library only: the command line checks SRC and DST before it imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from .. import GatedAttentionWarning
from ..hub.command_line import sigterm_as_interrupt
from ..hub.output_folders import OutputFolderError, check_output_folder, is_checkpoint
from ..hub.repo_ids import missing_folder
from .errors import ConversionError

# renameat2(2) flags, from <linux/fs.h>
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
CHECKPOINT = "a model checkpoint (no config.json with a model_type)"
STAGING_KINDS = ("incomplete", "replaced")  # .DST.incomplete-PID: being written; .DST.replaced-PID: the old DST, on its way out


def check_source(src: str, revision: str | None = None) -> None:
    """What can be told about SRC without reading it (the command line checks this before importing torch)."""
    if not src.strip():  # Path("") is ".", the working folder: the next message would be about DST
        raise ConversionError("SRC is empty: give a checkpoint folder or a Hub repo id")
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"SRC {src} is a file; give the checkpoint folder (the one with config.json)")
        if revision is not None:
            raise ConversionError(f"--revision is for a Hub repo id, and SRC {src} is a local folder")
    elif missing_folder(src):
        raise ConversionError(f"SRC {src}: no such folder")


def check_destination(src: Path | None, dst: Path, overwrite: bool) -> None:
    """Refuse a DST that exists (without `overwrite`), that is SRC (a folder; None: a Hub id), inside it or
    around it, that is the working folder or above it, or that holds anything but a model checkpoint."""
    dst = Path(dst)
    if dst.name in ("", ".", ".."):  # the staging folder goes beside DST and is renamed to it
        raise ConversionError(f"DST {dst} must name a folder to create, like ./out (not . or ..)")
    try:  # not the working folder or above it, not SRC, and replaced only if it is a checkpoint
        check_output_folder(dst, flag="DST", what=CHECKPOINT, ours=is_checkpoint, inputs={"SRC": src})
    except OutputFolderError as e:
        raise ConversionError(str(e)) from None
    if os.path.lexists(dst) and not overwrite:
        raise ConversionError(f"DST {dst} already exists; pass --overwrite to replace it")
    if dst.parent.exists() and not dst.parent.is_dir():
        raise ConversionError(f"DST {dst}: {dst.parent} is a file, not a folder")


# --- staging names ---------------------------------------------------------------------------------

NAME_MAX = 255  # bytes in one file name: Linux, macOS and Windows file systems alike
_PID_ROOM = 10  # digits of a process id, at most


def staging_prefix(dst: Path, kind: str) -> str:
    """`.DST.KIND-`, the name of a staging folder beside DST without its process id. For a DST name too long
    to take the additions (a valid name of up to 255 bytes), its head and a hash of it stand in, so the
    staging name is a valid name too and is the same for every run that writes this DST."""
    name = Path(dst).name
    prefix = f".{name}.{kind}-"
    if len(os.fsencode(prefix)) + _PID_ROOM <= NAME_MAX:
        return prefix
    digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
    room = NAME_MAX - _PID_ROOM - len(f"..{kind}-~{digest}")
    head = os.fsencode(name)[:room].decode("utf-8", errors="ignore")  # whole characters only
    return f".{head}~{digest}.{kind}-"


def staging_path(dst: Path, kind: str, pid: int | None = None) -> Path:
    return Path(dst).parent / f"{staging_prefix(dst, kind)}{os.getpid() if pid is None else pid}"


# --- room on the file system -----------------------------------------------------------------------


def check_free_space(dst: Path, needed: int) -> None:
    """ConversionError, naming DST, the bytes needed and those free, when DST's file system has no room for
    `needed` bytes (checked before writing: a write that fills the file system fails halfway, and a file
    read back through mmap from a full one can kill the process with SIGBUS)."""
    folder = Path(dst).parent.resolve()
    while not folder.exists():  # DST's parents may not exist yet: the first one that does holds them
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ConversionError(
            f"DST {dst}: {needed:,} bytes are needed and its file system has {free:,} free; "
            "nothing was written (free some space, or give a DST on another file system)"
        )


# --- renaming without replacing -------------------------------------------------------------------


def renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2(2). False where it is missing: another system, a libc without it (glibc < 2.28),
    a kernel or file system that does not know the flag; the caller then takes its portable path."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc_renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if libc_renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))  # FileExistsError for EEXIST


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; FileExistsError if anything is at `dst`, an empty folder included."""
    if renameat2(src, dst, RENAME_NOREPLACE):
        return
    if os.name == "nt":
        os.rename(src, dst)  # Windows' rename never replaces
        return
    # rename(2) replaces an empty folder, so DST is claimed first: mkdir fails if anything is there. If
    # someone writes into the claimed folder meanwhile, renaming onto it fails (ENOTEMPTY) and their file stays.
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # ours, if still empty
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, "written to while claimed", str(dst)) from e
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _replace(stage: Path, dst: Path) -> None:
    """`--overwrite`: put `stage` at `dst` and remove what was there, so DST is never half old, half new."""
    if renameat2(stage, dst, RENAME_EXCHANGE):  # one atomic swap; `stage` now names the old DST
        _remove(stage)
        return
    old = staging_path(dst, "replaced")
    os.replace(dst, old)
    try:
        rename_noreplace(stage, dst)
    except FileExistsError:
        raise ConversionError(
            f"DST {dst} appeared again while replacing it (made by another process?); it was left as it is, "
            f"and the previous DST is at {old}"
        ) from None
    _remove(old)


# --- what a killed run leaves behind --------------------------------------------------------------


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a folder named after this process is from an earlier process with the same id
    if os.name == "nt":
        return True  # no harmless liveness probe there (os.kill would terminate it): assume it runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def staging_leftovers(dst: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """Staging folders beside `dst`: those of dead processes, and (folder, pid) of running ones."""
    dead, running = [], []
    for kind in STAGING_KINDS:
        for path in sorted(dst.parent.glob(f"{glob.escape(staging_prefix(dst, kind))}*")):
            pid = path.name.rsplit("-", 1)[1]
            if not pid.isdigit():
                continue
            if _running(int(pid)):
                running.append((path, int(pid)))
            else:
                dead.append(path)
    return dead, running


def _handle_leftovers(dst: Path, overwrite: bool, log) -> None:
    """Name what killed runs left beside DST (or, with `overwrite`, remove it); folders of running processes stay."""
    dead, running = staging_leftovers(dst)
    notes = []
    if dead and overwrite:
        for path in dead:
            _remove(path)
        log(f"removed {len(dead)} folder(s) left beside DST by an interrupted run: {', '.join(p.name for p in dead)}")
    elif dead:
        notes.append(
            f"{len(dead)} folder(s) beside DST were left by an interrupted run: "
            f"{', '.join(p.name for p in dead)}; remove them (rm -r {' '.join(str(p) for p in dead)}) or pass --overwrite"
        )
    if running:
        notes.append(
            "another conversion to the same DST may be under way: "
            + ", ".join(f"{p.name} (process {pid} is running)" for p, pid in running)
            + "; left alone"
        )
    if notes:
        warnings.warn("; ".join(notes), GatedAttentionWarning)


# --- the staging folder ---------------------------------------------------------------------------


@contextlib.contextmanager
def staged_folder(dst: Path, overwrite: bool, log=print, *, size: int = 0) -> Iterator[Path]:
    """Yield a fresh staging folder beside `dst`; on success it becomes `dst`, on any failure it is removed.

    Without `overwrite`, it becomes `dst` only if nothing is there at that moment (ConversionError otherwise,
    and what is at `dst` stays as it is). `size`, the bytes about to be written, must fit in the free space
    (an old DST is removed only once the new one is in place, so it counts as taken); a file system that
    fills up anyway is one line naming DST, not an OSError.
    """
    dst = Path(dst)
    check_free_space(dst, size)
    made = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]  # removed again on failure
    dst.parent.mkdir(parents=True, exist_ok=True)
    _handle_leftovers(dst, overwrite, log)
    stage = staging_path(dst, "incomplete")
    if stage.exists():  # an earlier process with this id was killed (see `_running`)
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        with sigterm_as_interrupt():  # `kill PID` unwinds like Ctrl-C, so the staging folder is removed
            yield stage
            try:
                rename_noreplace(stage, dst)
            except FileExistsError:
                if not overwrite:
                    raise ConversionError(
                        f"DST {dst} appeared while writing (made by another process?); it was left as it is "
                        "and nothing was written; pass --overwrite to replace it"
                    ) from None
                _replace(stage, dst)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:  # deepest first; one that something else wrote into stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConversionError(
                f"DST {dst}: its file system is full ({e.strerror}) while writing {Path(e.filename or stage).name}; "
                "nothing was written (free some space, or give a DST on another file system)"
            ) from None
        raise
