"""The `--out` folder of every recipe: checked before anything is read, written whole or not at all.

A recipe writes into a staging folder beside `--out` (`files.staging.staged_folder`), renamed to `--out` when
the run is done. So a folder at `--out` is always one finished run: a rerun over it replaces it whole at the
end, and one stopped by Ctrl-C, SIGTERM or SIGKILL leaves it as it was (a killed run's staging folder, named
`.OUT.incomplete-PID`, is removed by the next run). A second run writing the same `--out`, or one inside it or
around it, is refused while the first runs. `--out` is never the working folder or above it, never holds
`--cache` or `--source` or lies inside them, and is replaced only when it is empty or an earlier recipe's
output (`is_recipe_output`): a user's folder is never taken.

Standard library only: the command line checks `--out` before it imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

from .. import CLIError, GatedAttentionWarning
from ..files.output_folders import OutputFolderError, check_output_folder
from ..files.staging import refuse_nested, refuse_running, staged_folder

SETTINGS = "settings.json"  # every recipe writes it first: its settings and where it ran (`common.Job.start`)
RUN_KEYS = ("device", "threads")  # what `common.Job.start` adds to it, whatever the recipe


def is_recipe_output(folder: Path) -> bool:
    """A recipe's output folder: its `settings.json` is an object that says where the run ran."""
    try:
        written = json.loads((Path(folder) / SETTINGS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and all(key in written for key in RUN_KEYS)


def _inputs(args: argparse.Namespace) -> dict[str, Path]:
    """The folders the run reads or fills outside `--out`, which `--out` must neither be, hold nor lie inside."""
    inputs = {}
    for flag, value in (("--cache", getattr(args, "cache", None)), ("--source", getattr(args, "source", None))):
        if value and Path(value).expanduser().exists():
            inputs[flag] = Path(value).expanduser()
    return inputs


def check_out(args: argparse.Namespace) -> Path:
    """CLIError, before anything is written, for an `--out` this run may not write (see the module doc)."""
    out = Path(args.out).expanduser()
    if out.name in ("", ".", ".."):  # the staging folder goes beside --out and is renamed to it
        raise CLIError(f"--out {args.out} must name a folder, like ./quickstart_out (not . or ..)")
    try:
        check_output_folder(out, flag="--out", what=f"an earlier quickstart's output ({SETTINGS} of a run)",
                            ours=is_recipe_output, inputs=_inputs(args))
        refuse_running(out, "--out")
        refuse_nested(out, "--out")
    except OutputFolderError as e:
        raise CLIError(str(e)) from None
    return out


@contextlib.contextmanager
def staged_out(args: argparse.Namespace, log=print) -> Iterator[Path]:
    """Yield the folder the run writes into; when the block ends without an error it becomes `--out` (replacing an
    earlier run's output whole), on any error or interruption it is removed and `--out` stays as it was."""
    out = check_out(args)
    try:
        with staged_folder(out, out.is_dir(), log, flag="--out", overwrite_flag=None, clear_leftovers=True,
                           warn=lambda message: warnings.warn(message, GatedAttentionWarning)) as stage:
            refuse_running(out, "--out", own=stage)  # another run that started at the same moment
            refuse_nested(out, "--out", own=stage)
            yield stage
    except OutputFolderError as e:
        raise CLIError(str(e)) from None
