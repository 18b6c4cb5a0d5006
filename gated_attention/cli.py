"""The `gated-attention` command line (also `python -m gated_attention`).

Each sub-command lives beside the code it drives and exposes
`register(subparsers)`, which adds its parser with `set_defaults(func=...)`.
The modules that define parsers import only argparse and the standard
library; `func` imports what the command uses when it runs. So `--help` and
usage errors answer without importing torch or transformers. The package's
`__init__` registers nothing while this command starts, so code that reads
our checkpoints through the Auto classes calls `register_auto_classes()`
first (and `convert --no-verify` of a dense model never imports the models).

Errors are one line on stderr and a non-zero exit, and so are the package's
warnings (`GatedAttentionWarning`). Set
`GATED_ATTENTION_DEBUG=1` to see tracebacks and Python's own warning format.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from . import CLIError, GatedAttentionWarning

_COMMAND_MODULES = [
    "gated_attention.convert.cli",
    "gated_attention.analysis.cli",
    "gated_attention.recipes.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gated-attention",
        description="Gated softmax attention and hybrid Gated DeltaNet models for transformers.",
    )
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
