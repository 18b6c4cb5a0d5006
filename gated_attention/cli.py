"""The `gated-attention` command line (also `python -m gated_attention`).

Each sub-command lives beside the code it drives and exposes
`register(subparsers)`, which adds its parser with `set_defaults(func=...)`.
The modules that define parsers import only argparse and the standard
library; `func` imports what the command uses when it runs. So `--help` and
usage errors answer without importing torch or transformers. The package's
`__init__` registers nothing while this command starts, so code that reads
our checkpoints through the Auto classes calls `register_auto_classes()`
first (and `convert --no-verify` of a dense model never imports the models).

Errors are one line on stderr and a non-zero exit: usage errors (argparse's,
status 2, with a pointer to `--help` instead of the usage block), bad input
(`CLIError`, status 2) and anything unexpected (status 1). Warnings of the
package (`GatedAttentionWarning`) are one line each too. Set
`GATED_ATTENTION_DEBUG=1` to see tracebacks and Python's own warning format.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import warnings

from . import CLIError, GatedAttentionWarning, __version__
from .cli_common import OneLineErrorParser

_COMMAND_MODULES = [
    "gated_attention.convert.cli",
    "gated_attention.analysis.cli",
    "gated_attention.analysis.stream_cli",
    "gated_attention.recipes.cli",
    "gated_attention.recipes.quantize_cli",
]


class _Version(argparse.Action):
    """`--version`: printed as is (argparse's own action rewraps it to the terminal's width)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """This package's version and those of the libraries it runs on, read from their metadata (no imports)."""
    versions = []
    for name in ("transformers", "torch", "huggingface_hub"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return f"gated-attention {__version__} ({', '.join(versions)})"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="gated-attention",
        description="Gated softmax attention and hybrid Gated DeltaNet models for transformers.",
    )
    parser.add_argument("--version", action=_Version, help="print the versions of gated-attention, transformers, torch and huggingface_hub, and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def _one_line_warning(command: str, show_default):
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, GatedAttentionWarning):
            print(f"gated-attention {command}: warning: {message}", file=sys.stderr)
        else:
            show_default(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = os.environ.get("GATED_ATTENTION_DEBUG") == "1"
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _one_line_warning(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except CLIError as e:
        if debug:
            raise
        print(f"gated-attention {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gated-attention {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
        if debug:
            raise
        print(f"gated-attention {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
