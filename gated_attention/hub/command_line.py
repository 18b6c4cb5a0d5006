"""Small pieces every command line of the package shares: a parser whose usage errors are one line, flag
values in a range, an exception as one line, SIGTERM handled as Ctrl-C.

`cli`, `analysis`, `convert`, `recipes`, `training`, the examples and the
benchmarks use these, so a range or a one-line error reads the same in every
command. Standard library only: the parsers build without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
from collections.abc import Iterator


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when the message is empty.

    Libraries (huggingface_hub, datasets, torch) write messages of many lines; a command reports one.
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the usage block is what `--help` is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
