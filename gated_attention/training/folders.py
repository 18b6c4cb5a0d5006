"""Output folders that a failed run does not leave behind empty."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

# What a run of the examples writes into its output folder (a folder holding one of them is a run's; nothing
# else in it is the run's to replace). `.final.incomplete-PID` and the like are `staged_folder`'s.
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
