"""One setting of the sink search (`benchmarks/sink_search.md`): the sinks preset, optionally for the ungated model alone.

    PYTHONPATH=. python benchmarks/sink_search.py --ungated-only --layers 8 --lr 6e-3 --out runs/sink_b

Takes every `gated-attention quickstart` flag (the sinks preset is implied) plus
`--ungated-only`, `--probe-every`, `--corpus-chars`: the search picks a setting by whether the ungated model forms a
sink, so the gated twin need not be trained while searching. Every setting tried
is written down, with its numbers, in `benchmarks/sink_search.md`.
"""

import platform
import sys
import time

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.recipes import cli


def main(argv=None) -> int:
    parser = OneLineErrorParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    ours = OneLineErrorParser(add_help=False)
    ours.add_argument("--ungated-only", action="store_true")
    ours.add_argument("--probe-every", type=bounded(int, 0))
    ours.add_argument("--corpus-chars", type=bounded(int, 1))
    extra, rest = ours.parse_known_args(argv)
    args = parser.parse_args(["quickstart", "--preset", "sinks", *rest])
    args.ungated_only = extra.ungated_only or None
    args.probe_every, args.corpus_chars = extra.probe_every, extra.corpus_chars
    t0 = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}; command: {' '.join(sys.argv)}", flush=True)
    rc = cli.run(args)  # the run logs its torch threads
    print(f"wall time {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
