"""One setting of the backcopy search (`benchmarks/backcopy_search.md`): the backcopy preset, optionally for the
control (ungated) model alone.

    PYTHONPATH=. python benchmarks/backcopy_search.py --ungated-only --steps 1000 --lr 3e-3 --out runs/bc_a

Takes every `gated-attention quickstart` flag (the backcopy preset is implied) plus `--ungated-only`,
`--probe-every`, and the task's `--tokens`, `--successors`, `--trigger-prob`, `--train-sequences` and `--lr-min-ratio`: the search picks
a setting by whether the control forms a sink, so the gated twin need not be trained while searching. Every
setting tried is written down, with its numbers, in `benchmarks/backcopy_search.md`.
"""

import platform
import sys
import time

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.recipes import backcopy, cli, settings


def main(argv=None) -> int:
    parser = OneLineErrorParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    ours = OneLineErrorParser(add_help=False)
    ours.add_argument("--ungated-only", action="store_true")
    ours.add_argument("--probe-every", type=bounded(int, 0))
    ours.add_argument("--tokens", type=bounded(int, 2), dest="n_tokens")
    ours.add_argument("--successors", type=bounded(int, 1))
    ours.add_argument("--trigger-prob", type=float)
    ours.add_argument("--train-sequences", type=bounded(int, 1))
    ours.add_argument("--lr-min-ratio", type=float)
    extra, rest = ours.parse_known_args(argv)
    args = parser.parse_args(["quickstart", "--preset", "backcopy", *rest])
    args.ungated_only = extra.ungated_only or None
    args.probe_every = extra.probe_every
    s = settings.backcopy_settings_from_args(args)
    for name in ("n_tokens", "successors", "trigger_prob", "train_sequences", "lr_min_ratio"):
        if getattr(extra, name) is not None:
            setattr(s, name, getattr(extra, name))
    t0 = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}; command: {' '.join(sys.argv)}", flush=True)
    rc = backcopy.run(args, s)
    print(f"wall time {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
