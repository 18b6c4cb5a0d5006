"""Output folders that appear whole or not at all: a staging folder beside the output, renamed into place.

`convert`, `extend`, `export` (DST) and `analyze` (`--out`) write everything into a hidden folder beside
their output (`.OUT.incomplete-PID`; for a name too long to take the additions, a head of it and its
hash: `staging_prefix`), which is renamed to the output only when complete, so an output folder that
exists is always whole. Ctrl-C and SIGTERM remove the staging folder; after a SIGKILL it stays behind,
marked incomplete by its name, and the next run names it (`overwrite` removes it). A staging folder
whose process still runs means another run is writing the same output: `staged_folder` says so, and
`refuse_running` makes that a refusal.

The final rename never replaces what is at the output at that moment, unless asked to (`overwrite`):
the output is checked when the command starts, but a folder may be made there while the command works
(minutes), and plain rename(2) silently replaces an empty folder, which its owner may be about to fill.
On Linux, renameat2(RENAME_NOREPLACE) makes the check and the rename one atomic step; elsewhere the
output is claimed with mkdir first (see `rename_noreplace`). With `overwrite`, RENAME_EXCHANGE swaps
the new folder in and the old one out in one step, so the output is never half old, half new.

Failures are `OutputFolderError`, one line naming the output by its flag (`DST`, `--out`).
Standard library only: the command lines check before they import torch.
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

from ..cli_common import sigterm_as_interrupt
from .output_folders import OutputFolderError

# renameat2(2) flags, from <linux/fs.h>
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
STAGING_KINDS = ("incomplete", "replaced")  # .OUT.incomplete-PID: being written; .OUT.replaced-PID: the old OUT, on its way out


# --- staging names ---------------------------------------------------------------------------------

NAME_MAX = 255  # bytes in one file name: Linux, macOS and Windows file systems alike
_PID_ROOM = 10  # digits of a process id, at most


def staging_prefix(dst: Path, kind: str) -> str:
    """`.OUT.KIND-`, the name of a staging folder beside `dst` without its process id. For a name too long
    to take the additions (a valid name of up to 255 bytes), its head and a hash of it stand in, so the
    staging name is a valid name too and is the same for every run that writes this output."""
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


def check_free_space(dst: Path, needed: int, flag: str = "DST") -> None:
    """OutputFolderError, naming `dst`, the bytes needed and those free, when its file system has no room for
    `needed` bytes (checked before writing: a write that fills the file system fails halfway, and a file
    read back through mmap from a full one can kill the process with SIGBUS)."""
    folder = Path(dst).parent.resolve()
    while not folder.exists():  # its parents may not exist yet: the first one that does holds them
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise OutputFolderError(
            f"{flag} {dst}: {needed:,} bytes are needed and its file system has {free:,} free; "
            f"nothing was written (free some space, or give a {flag} on another file system)"
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
    # rename(2) replaces an empty folder, so the output is claimed first: mkdir fails if anything is there. If
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


def _replace(stage: Path, dst: Path, flag: str) -> None:
    """Overwrite: put `stage` at `dst` and remove what was there, so `dst` is never half old, half new."""
    if renameat2(stage, dst, RENAME_EXCHANGE):  # one atomic swap; `stage` now names the old output
        _remove(stage)
        return
    old = staging_path(dst, "replaced")
    os.replace(dst, old)
    try:
        rename_noreplace(stage, dst)
    except FileExistsError:
        raise OutputFolderError(
            f"{flag} {dst} appeared again while replacing it (made by another process?); it was left as it is, "
            f"and the previous {flag} is at {old}"
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


def dead_staging_folders(folder: Path) -> list[Path]:
    """What processes that are gone left staging in `folder`, for any output: `.NAME.incomplete-PID` entries
    (the `replaced` kind is left alone: between the two renames of a non-Linux swap it is the only whole copy)."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob(".*.incomplete-*")):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _running(int(pid)):
            found.append(path)
    return found


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


def _handle_leftovers(dst: Path, clear: bool, log, warn, flag: str, overwrite_flag: str) -> None:
    """Name what killed runs left beside `dst` (or, with `clear`, remove it); folders of running processes stay."""
    dead, running = staging_leftovers(dst)
    notes = []
    if dead and clear:
        for path in dead:
            _remove(path)
        log(f"removed {len(dead)} folder(s) left beside {flag} by an interrupted run: {', '.join(p.name for p in dead)}")
    elif dead:
        notes.append(
            f"{len(dead)} folder(s) beside {flag} were left by an interrupted run: "
            f"{', '.join(p.name for p in dead)}; remove them (rm -r {' '.join(str(p) for p in dead)}) or pass {overwrite_flag}"
        )
    if running:
        notes.append(
            f"another run writing the same {flag} may be under way: "
            + ", ".join(f"{p.name} (process {pid} is running)" for p, pid in running)
            + "; left alone"
        )
    if notes:
        warn("; ".join(notes))


# --- the staging folder ---------------------------------------------------------------------------


def refuse_running(dst: Path, flag: str, own: Path | None = None) -> None:
    """OutputFolderError when another running process is writing `dst` (its staging folder is there).

    With `own`, this process's staging folder, only a run that made its staging folder first counts:
    two runs that start at the same moment both get past the check made before they staged, and then
    exactly one of them (the later, by creation time, then process id) gives way.
    """
    _, running = staging_leftovers(Path(dst))
    if own is not None:
        mine = (os.stat(own).st_mtime_ns, os.getpid())
        running = [(path, pid) for path, pid in running if (os.stat(path).st_mtime_ns, pid) < mine]
    if running:
        path, pid = running[0]
        raise OutputFolderError(
            f"{flag} {dst} is being written by another run (process {pid}, {path.name}); wait for it or give "
            f"another {flag}"
        )


def running_inside_or_around(dst: Path) -> list[tuple[Path, int]]:
    """(staging folder, pid) of running processes writing an output inside `dst` (their staging folder is
    in it) or one that holds `dst` (theirs is beside one of its parents). Replacing `dst` whole would take
    the first one's output away; the second one will replace `dst`'s parent whole, with this output."""
    dst = Path(os.path.abspath(dst))
    found = []
    if dst.is_dir():
        for root, folders, _ in os.walk(dst):
            for name in folders:
                pid = name.rsplit("-", 1)[-1]
                if name.startswith(".") and f".{STAGING_KINDS[0]}-" in name and pid.isdigit() and _running(int(pid)):
                    found.append((Path(root) / name, int(pid)))
    for parent in list(dst.parents)[:-1]:  # not the root, which has no name to stage beside
        found += staging_leftovers(parent)[1]
    return found


def refuse_nested(dst: Path, flag: str, own: Path | None = None) -> None:
    """OutputFolderError when another running process writes an output inside `dst` or around it
    (`running_inside_or_around`). With `own`, this process's staging folder, only a run that staged first
    counts (as in `refuse_running`)."""
    running = running_inside_or_around(dst)
    if own is not None:
        mine = (os.stat(own).st_mtime_ns, os.getpid())
        running = [(path, pid) for path, pid in running if (os.stat(path).st_mtime_ns, pid) < mine]
    if running:
        path, pid = running[0]
        where = "inside" if Path(os.path.abspath(path)).is_relative_to(os.path.abspath(dst)) else "around"
        raise OutputFolderError(
            f"{flag} {dst}: another run is writing an output {where} it (process {pid}, {path}); wait for it or "
            f"give another {flag}"
        )


@contextlib.contextmanager
def staged_folder(
    dst: Path,
    overwrite: bool,
    log=print,
    *,
    size: int = 0,
    flag: str = "DST",
    overwrite_flag: str | None = "--overwrite",
    clear_leftovers: bool | None = None,
    warn=lambda message: warnings.warn(message, stacklevel=3),
) -> Iterator[Path]:
    """Yield a fresh staging folder beside `dst`; on success it becomes `dst`, on any failure it is removed.

    Without `overwrite`, it becomes `dst` only if nothing is there at that moment (OutputFolderError
    otherwise, and what is at `dst` stays as it is). `size`, the bytes about to be written, must fit in the
    free space (an old output is removed only once the new one is in place, so it counts as taken); a file
    system that fills up anyway is one line naming `dst`, not an OSError. `flag` names the output in
    messages, `overwrite_flag` the option that replaces it (None: none, a rerun does). Staging folders that killed runs left behind
    are removed when `clear_leftovers` (default: `overwrite`), else named through `warn`.
    """
    dst = Path(dst)
    check_free_space(dst, size, flag)
    made = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]  # removed again on failure
    dst.parent.mkdir(parents=True, exist_ok=True)
    _handle_leftovers(dst, overwrite if clear_leftovers is None else clear_leftovers, log, warn, flag, overwrite_flag)
    stage = staging_path(dst, "incomplete")
    if stage.exists():  # an earlier process with this id was killed (see `_running`)
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        with sigterm_as_interrupt():
            yield stage
            try:
                rename_noreplace(stage, dst)
            except FileExistsError:
                if not overwrite:
                    again = f"pass {overwrite_flag} to replace it" if overwrite_flag else "run again to replace it"
                    raise OutputFolderError(
                        f"{flag} {dst} appeared while writing (made by another process?); it was left as it is "
                        f"and nothing was written; {again}"
                    ) from None
                _replace(stage, dst, flag)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:  # deepest first; one that something else wrote into stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputFolderError(
                f"{flag} {dst}: its file system is full ({e.strerror}) while writing {Path(e.filename or stage).name}; "
                f"nothing was written (free some space, or give a {flag} on another file system)"
            ) from None
        raise
