"""How fast the package and the `gated-attention` command start, against torch and transformers, in one run.

Every measurement is a fresh interpreter (wall time of the whole process, Python's own start included),
repeated `--repeats` times with the commands interleaved, so load that comes and goes on the machine
hits every command alike; the fastest run of each counts (noise only slows down), the median is shown.

- `gated-attention [COMMAND] --help` / `python -c "import torch"`, for the top-level help and every
  subcommand's, `--version`, and command lines that are refused before anything is read (`extend`
  without a RoPE option, `convert --max-shard-size abc`) (target <= 0.5x: none imports torch or transformers);
- `python -c "import gated_attention"` / importing torch plus transformers' `PreTrainedModel` and Auto
  classes (target <= 1.3x: the import registers our models with the Auto classes, so it needs those);
- `--convert` also runs `benchmarks/convert.py` (builds a 2.2 GB checkpoint; minutes), whose ratio is
  `convert --no-verify` / a plain safetensors load-and-save pass (target <= 1.5x).

    python benchmarks/startup.py [--repeats 7] [--convert]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, bounded

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["convert", "extend", "export", "analyze", "quickstart"]
BASELINE_IMPORTS = "import torch; from transformers import PreTrainedModel, AutoConfig, AutoModel, AutoModelForCausalLM"


def wall(argv: list[str], returncode: int = 0) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != returncode:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}, not {returncode}:\n{proc.stderr[-2000:]}")
    return seconds


def command_prefix() -> tuple[list[str], str]:
    """The console script pip installed beside this Python (what `gated-attention` runs), else `python -m`."""
    script = Path(sys.executable).parent / "gated-attention"
    if script.exists():
        return [str(script)], "gated-attention"
    return [sys.executable, "-m", "gated_attention"], "python -m gated_attention"


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=bounded(int, 1), default=7)
    parser.add_argument("--convert", action="store_true", help="also run benchmarks/convert.py (minutes, ~7 GB scratch)")
    args = parser.parse_args()

    py = sys.executable
    prefix, shown = command_prefix()
    src = Path(tempfile.mkdtemp(prefix="startup-src-"))  # refused before it is read: a config.json suffices
    (src / "config.json").write_text("{}")
    dst = str(src.parent / f"{src.name}-out")
    runs = {
        "python -c pass": [py, "-c", "pass"],
        "import torch": [py, "-c", "import torch"],
        "import torch + transformers (PreTrainedModel, Auto*)": [py, "-c", BASELINE_IMPORTS],
        "import gated_attention": [py, "-c", "import gated_attention"],
        f"{shown} --help": [*prefix, "--help"],
        "python -m gated_attention --help": [py, "-m", "gated_attention", "--help"],
        **{f"{shown} {c} --help": [*prefix, c, "--help"] for c in COMMANDS},
        f"{shown} --version": [*prefix, "--version"],
        f"{shown} extend SRC DST (refused)": [*prefix, "extend", str(src), dst],
        f"{shown} convert SRC DST --max-shard-size abc (refused)": [*prefix, "convert", str(src), dst, "--max-shard-size", "abc"],
    }
    refused = {name for name in runs if name.endswith("(refused)")}
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for name, argv in runs.items():  # one untimed run each: the file cache is warm for all alike
            wall(argv, 2 if name in refused else 0)
        for _ in range(args.repeats):
            for name, argv in runs.items():
                times[name].append(wall(argv, 2 if name in refused else 0))
    finally:
        shutil.rmtree(src)
    best = {name: min(t) for name, t in times.items()}

    print(f"{args.repeats} interleaved runs each, fresh processes; seconds (min / median)")
    for name, t in times.items():
        print(f"  {name:<72}{min(t):>7.3f}{statistics.median(t):>8.3f}")

    torch_s = best["import torch"]
    print("\n--help, --version and refused command lines / import torch (target <= 0.5x):")
    help_rows = [name for name in runs if name.endswith(("--help", "--version", "(refused)"))]
    for name in help_rows:
        print(f"  {name:<72}{best[name] / torch_s:>6.2f}x")
    print(f"  worst{'':<67}{max(best[n] for n in help_rows) / torch_s:>6.2f}x")
    ratio = best["import gated_attention"] / best["import torch + transformers (PreTrainedModel, Auto*)"]
    print(f"\nimport gated_attention / import torch + transformers (PreTrainedModel, Auto*): {ratio:.2f}x (target <= 1.3x)")

    if args.convert:
        print("\nbenchmarks/convert.py:", flush=True)
        subprocess.run([py, str(REPO / "benchmarks" / "convert.py")], cwd=REPO, check=True)
    else:
        print("convert --no-verify / plain load+save at 2.2 GB: run with --convert, or python benchmarks/convert.py "
              "(target <= 1.5x)")


if __name__ == "__main__":
    main()
