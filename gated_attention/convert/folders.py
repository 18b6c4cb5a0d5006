"""SRC and DST of `convert`, `extend` and `export` on disk: the checks that need no file content, and the
staging folder that DST appears from, whole or not at all (`files.staging`). DST is never lost.

Standard library only: the command line checks SRC and DST before it imports torch.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

from .. import GatedAttentionWarning
from ..files import staging
from ..files.output_folders import OutputFolderError, check_output_folder, is_checkpoint
from ..hub.repo_ids import missing_folder
from .errors import ConversionError

CHECKPOINT = "a model checkpoint (no config.json with a model_type)"


def check_source(src: str, revision: str | None = None) -> None:
    """What can be told about SRC without reading it (the command line checks this before importing torch)."""
    if not src.strip():  # Path("") is ".", the working folder: the next message would be about DST
        raise ConversionError("SRC is empty: give a checkpoint folder or a Hub repo id")
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir() and path.suffix.lower() != ".gguf":
            raise ConversionError(f"SRC {src} is a file; give the checkpoint folder (the one with config.json) or a .gguf file")
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


@contextlib.contextmanager
def staged_folder(dst: Path, overwrite: bool, log=print, *, size: int = 0) -> Iterator[Path]:
    """`files.staging.staged_folder` for DST: its refusals are `ConversionError`s, its notes `GatedAttentionWarning`s."""
    try:
        with staging.staged_folder(
            dst, overwrite, log, size=size, warn=lambda message: warnings.warn(message, GatedAttentionWarning)
        ) as stage:
            yield stage
    except OutputFolderError as e:
        raise ConversionError(str(e)) from None
