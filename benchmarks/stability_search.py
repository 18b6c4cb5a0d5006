"""One setting of the stability search (`benchmarks/stability_search.md`): the stability preset, for the control
(ungated) model alone unless `--arms` says otherwise.

    PYTHONPATH=. nice -n 10 python benchmarks/stability_search.py --layers 4 --hidden-size 64 --lrs 0.01,0.1,1 \\
        --out runs/stab_a

Takes every `gated-attention quickstart` flag (the stability preset is implied) plus the schedule's
`--max-grad-norm` (0: no clipping), `--warmup-fraction`, `--lr-min-ratio` and `--eval-every`: the search picks
depth, width, steps and the range of rates by where the control fails, so the other arms need not be trained
while searching. Every setting tried is written down, with its numbers, in `benchmarks/stability_search.md`.
"""

import platform
import sys
import time

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.recipes import cli, settings, stability


def main(argv=None) -> int:
    parser = OneLineErrorParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    ours = OneLineErrorParser(add_help=False)
    ours.add_argument("--max-grad-norm", type=bounded(float, 0))
    ours.add_argument("--warmup-fraction", type=bounded(float, 0, strict=True, high=1))
    ours.add_argument("--lr-min-ratio", type=bounded(float, 0))
    ours.add_argument("--eval-every", type=bounded(int, 1))
    extra, rest = ours.parse_known_args(argv)
    args = parser.parse_args(["quickstart", "--preset", "stability", *rest])
    if args.arms is None:
        args.arms = ["control"]
    s = settings.stability_settings_from_args(args)
    for name in ("max_grad_norm", "warmup_fraction", "lr_min_ratio", "eval_every"):
        if getattr(extra, name) is not None:
            setattr(s, name, getattr(extra, name))
    t0 = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}; command: {' '.join(sys.argv)}", flush=True)
    rc = stability.run(args, s)
    print(f"wall time {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
