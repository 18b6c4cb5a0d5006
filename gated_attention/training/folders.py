"""Output folders: made so that a failed run does not leave them behind empty, written so that a killed
save leaves nothing that looks complete (`final/`, `merged/` and every checkpoint are staged beside their
place and renamed into it), cleared at the next start of what killed saves left, cleared for a rerun only of
what a run writes; a file system that fills up during a save is one line (`DiskFullError`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..cli_common import first_line, format_size
from ..files.staging import RENAME_EXCHANGE, dead_staging_folders, renameat2, staging_path

# What a run of the examples writes into its output folder (a folder holding one of them is a run's; nothing
# else in it is the run's to replace). `.final.incomplete-PID` and the like are `staging_path`'s.
RUN_ENTRIES = ("log.jsonl", "checkpoints", "final", "merged", "final-yarn", "perplexity_by_length.csv")


class DiskFullError(ValueError):
    """A save that found its file system full: one line naming the folder and the space left."""


# How a full disk reads where it is no OSError: safetensors' SafetensorError, torch.save's RuntimeError.
_FULL = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")
# torch.save's zip writer (its C++ stream, for a path) says no errno: its stream stops short, "basic_ios::clear:
# iostream error" where a write fails, then "[enforce fail at inline_container.cc:...] unexpected pos N vs M" as it
# closes the archive. A local file's write fails so when its file system is full (or over quota).
_SHORT_WRITE = ("basic_ios::clear: iostream error", "unexpected pos")


def _full_disk(error: BaseException) -> str | None:
    """Why `error` (or an error it was raised while handling) is a full file system, in a few words; None if not."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) or \
                any(text in str(error) for text in _FULL):
            return first_line(error)
        if isinstance(error, RuntimeError) and any(text in str(error) for text in _SHORT_WRITE):
            return f"torch.save could not write the whole file: {first_line(error)}"
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def full_disk_is_one_line(folder, what: str) -> Iterator[None]:
    """Inside the block, a file system that fills up is a `DiskFullError` naming `what` was saved, `folder`
    and the space free after the block's own cleanup (run it around a staged save, whose staging folder is
    gone by then): nothing of the save is kept, and what was saved before is as it was."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - tested for a full disk below, re-raised otherwise
        why = _full_disk(e)
        if why is None:
            raise
        folder = Path(folder)
        held = next(p for p in (folder, *folder.parents) if p.exists())
        free = shutil.disk_usage(held).free
        raise DiskFullError(
            f"{what}: the file system of {folder} is full ({why}), {format_size(free)} free; nothing of "
            "this save was kept and what was saved before is as it was (free some space and resume)"
        ) from None


def clear_killed_saves(path: Path, log=print) -> None:
    """Remove the staging folders (and the log's staging file) that saves killed with SIGKILL left in `path` and
    `path/checkpoints` (`.step-0000004.incomplete-PID`, `.final.incomplete-PID`): their process is gone, and
    nothing reads them. Those of running processes stay."""
    dead = [leftover for folder in (path, path / "checkpoints") for leftover in dead_staging_folders(folder)]
    for leftover in dead:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)  # another process of this run may be removing it too
        else:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    if dead:
        log(f"removed what {len(dead)} killed save(s) left in {path}: {', '.join(p.name for p in dead)}")


@contextlib.contextmanager
def output_folder(path) -> Iterator[Path]:
    """Create `path` (and its missing parents) for a run, clearing what killed saves left in it
    (`clear_killed_saves`); if the run fails, remove the folders it created that are still empty. Nothing
    else is removed: not what existed before, not what the run wrote."""
    path = Path(path)
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    path.mkdir(parents=True, exist_ok=True)
    clear_killed_saves(path)
    try:
        yield path
    except BaseException:
        for folder in created:
            try:
                folder.rmdir()  # refuses a folder that is not empty
            except FileNotFoundError:  # another process of the run removed it
                continue
            except OSError:
                break
        raise


def publish(stage: Path, path) -> None:
    """Rename the whole folder `stage` to `path`. An earlier `path` (a checkpoint saved again after a resume,
    `final/` of an earlier run) is never written into: on Linux the two are swapped in one atomic step
    (renameat2 RENAME_EXCHANGE) and the old one removed after; elsewhere it is moved aside first, so a
    process killed in the instant between the two renames leaves both, whole, under their hidden names."""
    path = Path(path)
    if not os.path.lexists(path):
        os.rename(stage, path)
    elif renameat2(stage, path, RENAME_EXCHANGE):  # `stage` now names the old folder
        shutil.rmtree(stage)
    else:
        old = staging_path(path, "replaced")
        os.rename(path, old)
        os.rename(stage, path)
        shutil.rmtree(old)


@contextlib.contextmanager
def staged_output(path) -> Iterator[Path]:
    """Yield an empty staging folder beside `path` (`.NAME.incomplete-PID`, `files.staging.staging_path`); when
    the block ends without an error it is renamed to `path` (`publish`, replacing an earlier one), on any
    error it is removed. A process killed meanwhile leaves only the staging folder, incomplete by its name,
    never a `path` that looks whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_path(path, "incomplete")
    shutil.rmtree(stage, ignore_errors=True)  # an earlier process with this id was killed
    stage.mkdir()
    try:
        yield stage
        publish(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def remove_run(path) -> list[str]:
    """Remove what a run wrote into `path` (`RUN_ENTRIES`, for `--overwrite`), nothing else; returns the names."""
    removed = []
    for name in RUN_ENTRIES:
        entry = Path(path) / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif os.path.lexists(entry):
            entry.unlink()
        else:
            continue
        removed.append(name)
    return removed
