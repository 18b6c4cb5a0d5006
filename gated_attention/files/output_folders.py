"""The folders the commands and examples write into, and what they may replace there. Standard library only.

`convert`, `extend` and `export` write DST, `analyze` writes `--out`, the examples write `--output-dir`;
with `--overwrite` (or on a rerun) they replace what is there. They may replace only what the package
itself writes, so `check_output_folder` refuses, before anything is read or written:

- a folder that, resolved (symlinks, `..`, relative or absolute spelling), is the working folder or
  above it: replacing it would take the user's files, and the shell's working folder, with it;
- a folder that is an input (SRC, `--model`), inside one or above one: inputs are never modified;
- a non-empty folder that is not one of ours (`ours`, e.g. `is_checkpoint`): it is named by one entry it
  holds, so the user sees what would have been lost;
- a file where a folder should be.

Each caller turns `OutputFolderError` into its own one-line error. The checks read only the file system,
so the command line makes them before importing torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path


class OutputFolderError(ValueError):
    """An output folder that must not be written or replaced; the message is one readable line."""


def is_checkpoint(folder: Path) -> bool:
    """A model checkpoint: `config.json` whose `model_type` is a non-empty string (what transformers loads)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str) and bool(config["model_type"])


def holds_any(*names: str) -> Callable[[Path], bool]:
    """`ours` for a folder the package recognises by one of the entries it writes (a run's `log.jsonl`, ...)."""

    def ours(folder: Path) -> bool:
        return any(os.path.lexists(Path(folder) / name) for name in names)

    return ours


def _first_entry(folder: Path) -> str | None:
    """One entry of `folder`, files before folders, in name order (None if it is empty)."""
    with os.scandir(folder) as it:
        entries = sorted((not e.is_file(follow_symlinks=False), e.name) for e in it)
    return entries[0][1] if entries else None


def check_output_folder(
    path,
    *,
    flag: str,
    what: str,
    ours: Callable[[Path], bool],
    inputs: Mapping[str, object] | None = None,
) -> None:
    """Refuse an output folder that writing or replacing could lose a user's files in (see the module doc).

    `flag` names the folder in messages (`DST`, `--out`, `--output-dir`); `what` says what `ours` accepts
    ("a model checkpoint (config.json with a model_type)"); `inputs` maps a name (`SRC`, `--model`) to
    an input folder, or to None for an input that is no local folder (a Hub id).
    """
    path = Path(path).expanduser()
    where = path.resolve()
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        place = "is the working folder" if where == cwd else f"contains the working folder {cwd}"
        raise OutputFolderError(f"{flag} {path} {place}; give a folder of its own, like ./out")
    for name, folder in (inputs or {}).items():
        if folder is None:
            continue
        source = Path(folder).expanduser().resolve()
        if where == source or source in where.parents or where in source.parents:
            raise OutputFolderError(f"{flag} {path} must not be {name}, inside {name} or contain it ({name} is never modified)")
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise OutputFolderError(f"{flag} {path} is a file, not a folder; it is left as it is")
    entry = _first_entry(path)
    if entry is not None and not ours(path):
        raise OutputFolderError(
            f"{flag} {path} holds {entry!r} and is not {what}; it is left as it is: give a new or empty folder"
        )
