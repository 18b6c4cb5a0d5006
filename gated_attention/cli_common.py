"""Small pieces every command line of the package shares: a parser whose usage errors are one line, flag
values in a range, an existing file, a device name, memory sizes (`--max-memory 4GB`), the Hub-facing flags
(`--revision`, `--push-to-hub` with `--private`), an exception as one line, SIGTERM handled as Ctrl-C.

`cli`, `analysis`, `convert`, `recipes`, `training`, the examples and the
benchmarks use these, so a range or a one-line error reads the same in every
command. Standard library only: the parsers build without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import decimal
import math
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when the message is empty.

    Libraries (huggingface_hub, datasets, torch) write messages of many lines; a command reports one. A first
    line that ends in a colon announces a list ("... from one of:"), so the message is then joined into one line.
    """
    text = str(error).strip()
    if not text:
        return type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines) if lines[0].endswith(":") else lines[0]


def bounded(kind: type = int, low: float = 1, *, strict: bool = False, high: float | None = None):
    """An argparse `type`: a finite `kind` (int or float) >= `low` (> `low` when `strict`; < `high` if given).

    A value out of range is a usage error naming the flag and the range, before anything runs.
    """
    word = "an integer" if kind is int else "a number"
    wanted = f"{word} {'>' if strict else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


def existing_file(text: str) -> str:
    """An argparse `type`: the path of a file that exists (a folder or a missing path is a usage error)."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'is a folder, not a file' if path.is_dir() else 'no such file'}")
    return text


# What torch accepts as one device; "auto" lets the command choose (a GPU where there is one).
DEVICE = re.compile(r"^(auto|cpu|mps|(cuda|xpu|npu|hpu|mtia)(:\d+)?)$")


def device_name(text: str) -> str:
    """An argparse `type`: auto or a torch device (cpu, cuda, cuda:N, mps, xpu, ...), checked without torch."""
    if not DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N, mps, xpu or xpu:N, got {text!r}")
    return text


# A memory size as accelerate's `max_memory` and huggingface_hub's `max_shard_size` write it: decimal units
# (KB, MB, GB, TB) are powers of 10, binary ones (KiB, MiB, GiB, TiB) powers of 2; a bare number is bytes.
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"4GB", "512MiB", "1.5GB" or "1000000" in bytes (ValueError when it is no size)."""
    found = _SIZE.match(text)
    if not found or found[2].upper() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 4GB or 512MiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {text!r}")
    # Decimal, not float: a number of 400 digits is a size too large for anything (refused by its caller), not
    # an OverflowError from int(inf).
    return int(decimal.Decimal(found[1]) * _SIZE_UNITS[found[2].upper()])


def format_size(size: int) -> str:
    """Bytes as a person reads them, in decimal units like `parse_size`'s (`format_size(1_500_000_000) == "1.50 GB"`)."""
    for unit in ("TB", "GB", "MB", "KB"):
        if size >= _SIZE_UNITS[unit]:
            return f"{size / _SIZE_UNITS[unit]:.2f} {unit}"
    return f"{size} B"


def physical_memory() -> int | None:
    """The machine's RAM in bytes, or None where the system does not say (os.sysconf is POSIX)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def memory_size(text: str) -> int:
    """An argparse `type` for `--max-memory SIZE`: a size above zero and at most this machine's RAM.

    More than the machine has would bound nothing (a typed TB for GB), so it is a usage error too, before
    anything runs.
    """
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above zero, got {text!r}")
    ram = physical_memory()
    if ram is not None and size > ram:
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(f"{shown} is more than this machine's memory ({format_size(ram)})")
    return size


def add_revision(p: argparse.ArgumentParser, what: str = "SRC") -> None:
    """`--revision REV`, the same on every command that reads a checkpoint by Hub id."""
    p.add_argument("--revision", metavar="REV",
                   help=f"Hub revision (branch, tag or commit hash) when {what} is a Hub repo id: read from the Hugging "
                        "Face cache at that revision, else downloaded where the network allows (default: main)")


def revision_problem(names: list[str], revision: str | None, what: str = "MODEL") -> str | None:
    """Why `--revision` cannot apply (None when it can): it names a revision of a Hub id, and every one of
    `names` is a local path. With several names it applies to those that are Hub ids."""
    local = [name for name in names if Path(name).expanduser().exists()]
    if revision is not None and names and len(local) == len(names):
        return f"--revision is for a Hub repo id, and {what} {local[0]} is a local folder"
    return None


def add_push_to_hub(p: argparse.ArgumentParser, what: str = "DST") -> None:
    """`--push-to-hub REPO_ID` and `--private`, the same on every command that writes a checkpoint."""
    p.add_argument("--push-to-hub", metavar="REPO_ID",
                   help=f"once {what} is written and verified, upload it to this Hub model repo in one commit (the repo "
                        "is created if missing; needs a token, `hf auth login`). A failed push leaves DST whole and says "
                        "how to retry")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the usage block is what `--help` is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_command(subparsers, name: str, run, summary: str, *description: str) -> argparse.ArgumentParser:
    """The parser of the command `name`, which `run(args)` runs: `summary` for the commands' list, the
    `description` paragraphs (joined by spaces) for its `--help`."""
    parser = subparsers.add_parser(name, help=summary, description=" ".join(description))
    parser.set_defaults(func=run)
    return parser


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM (`kill PID`, and what launchers send their workers) raises KeyboardInterrupt,
    so it unwinds like Ctrl-C: staging folders are removed, the command says it was interrupted.

    Signals belong to the main thread: elsewhere nothing changes.
    """

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
