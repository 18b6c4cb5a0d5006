"""Output folders: made so that a failed run does not leave them behind empty, written so that a killed
save leaves nothing that looks complete (`final/`, `merged/` and every checkpoint are staged beside their
place and renamed into it), and cleared for a rerun only of what a run writes."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..hub.staging import RENAME_EXCHANGE, renameat2, staging_path

# What a run of the examples writes into its output folder (a folder holding one of them is a run's; nothing
# else in it is the run's to replace). `.final.incomplete-PID` and the like are `staging_path`'s.
RUN_ENTRIES = ("log.jsonl", "checkpoints", "final", "merged", "final-yarn", "perplexity_by_length.csv")


@contextlib.contextmanager
def output_folder(path) -> Iterator[Path]:
    """Create `path` (and its missing parents) for a run; if the run fails, remove the folders it created
    that are still empty. Nothing else is removed: not what existed before, not what the run wrote."""
    path = Path(path)
    created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    path.mkdir(parents=True, exist_ok=True)
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
    """Yield an empty staging folder beside `path` (`.NAME.incomplete-PID`, `hub.staging.staging_path`); when
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
