"""CPU threads for training: the default rule against `--threads 1` (and torch's own default), idle and busy, in one run.

    python benchmarks/threads.py [--steps 30] [--repeats 2] [--load N]

Each measurement is a fresh interpreter that trains quickstart's gated model
(`recipes.settings.Settings`: 4 layers, width 128, sequences of 128, batch 16)
on quickstart's data (the embedded corpus and tokenizer, cached on first use)
with the shared training loop for `--steps` steps, and reports steps per second
over all steps but the first three. Three thread settings, interleaved:

- `default`: what quickstart and the examples now choose (`training.threads.set_cpu_threads`);
- `1`: `--threads 1`;
- `torch`: torch's own default (one thread per core), the old behaviour.

Two phases: the machine as found (idle, or whatever else runs on it: the load
average is printed), then with `--load` busy-looping processes started by this
script (default: one per usable core). The busy phase starts once the 1-minute
load average has taken the load in (at most 90 s), as for a user who starts a
run on a machine that has been busy, which is what the default rule reads.
Prints a table: per phase and setting, the median steps/s over the repeats (and
their range: load from other processes comes and goes) and its ratio to
`--threads 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # it runs from a checkout without the package installed, as its children do

from gated_attention.cli_common import OneLineErrorParser, bounded  # noqa: E402

MODES = ("default", "1", "torch")


def child(mode: str, steps: int) -> None:
    """Train quickstart's gated model for `steps` steps with the thread setting `mode`; print one JSON line."""
    import torch

    from gated_attention.recipes.common import model_pair
    from gated_attention.recipes.settings import Settings
    from gated_attention.training import TrainConfig, data, make_optimizer, make_scheduler, train
    from gated_attention.training.threads import load_average, set_cpu_threads

    load = load_average()
    reason = "torch's default"
    if mode != "torch":
        _, reason = set_cpu_threads(None if mode == "default" else int(mode))
    s = Settings()
    tokenizer = data.load_tokenizer(s.vocab_size)
    rows = data.pack(data.corpus_tokens(tokenizer, "train"), s.seq_len, tokenizer.bos_token_id)
    _, model = model_pair(s, tokenizer)
    config = TrainConfig(steps=steps, batch_size=s.batch_size, lr=s.lr, gate_lr=s.gate_lr, seed=s.seed,
                         warmup_steps=max(1, int(s.warmup_fraction * steps)))
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    history = train(model, rows, config, optimizer, make_scheduler(optimizer, steps, config.warmup_steps),
                    progress=False)
    timed = history[-1]["seconds"] - history[2]["seconds"]  # the first three steps warm up allocators
    print(json.dumps({"mode": mode, "threads": torch.get_num_threads(), "reason": reason, "load": load,
                      "steps_per_s": (len(history) - 3) / timed}))


def measure(mode: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"child {mode} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def phase(name: str, steps: int, repeats: int) -> list[dict]:
    results = []
    for r in range(repeats):
        for mode in MODES:
            m = measure(mode, steps)
            m["phase"] = name
            results.append(m)
            print(f"  {name} #{r + 1} {mode:>7}: {m['threads']} thread(s), {m['steps_per_s']:.2f} steps/s "
                  f"(load average {m['load']:.1f}; {m['reason']})", flush=True)
    return results


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=bounded(int, 4), default=30,
                        help="training steps per measurement (first 3 untimed)")
    parser.add_argument("--repeats", type=bounded(int, 1), default=2,
                        help="measurements per setting and phase (median counts)")
    parser.add_argument("--load", type=bounded(int, 1),
                        help="busy processes in the loaded phase (default: one per usable core)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps)
        return 0

    import torch

    from gated_attention.recipes.settings import Settings
    from gated_attention.training import data
    from gated_attention.training.threads import load_average, usable_cores

    cores = usable_cores()
    n_load = args.load if args.load is not None else cores
    print(f"torch {torch.__version__}, {cores} usable cores ({os.cpu_count()} in the machine); quickstart's model, "
          f"{args.steps} steps per measurement, {args.repeats} repeat(s)", flush=True)
    tokenizer = data.load_tokenizer(Settings().vocab_size)  # trained and tokenized once, cached for the children
    data.corpus_tokens(tokenizer, "train")

    results = phase("as found", args.steps, args.repeats)
    load = start_load(n_load)
    try:
        target, t0 = load_average() + 0.6 * n_load, time.monotonic()
        while load_average() < target and time.monotonic() - t0 < 90:
            time.sleep(5)
        print(f"  {n_load} busy process(es) started; load average {load_average():.1f} after "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        results += phase(f"busy (+{n_load})", args.steps, args.repeats)
    finally:
        for p in load:
            p.kill()
            p.wait()

    print(f"\n{'phase':<12} {'setting':<16} {'threads':>7} {'load avg':>8} {'steps/s':>8} {'(range)':>13} "
          f"{'/ --threads 1':>13}")
    for name in dict.fromkeys(r["phase"] for r in results):
        rows = [r for r in results if r["phase"] == name]
        speeds = {m: [r["steps_per_s"] for r in rows if r["mode"] == m] for m in MODES}
        median = {m: statistics.median(v) for m, v in speeds.items()}
        for m, label in (("default", "default (rule)"), ("1", "--threads 1"), ("torch", "torch's default")):
            picked = sorted({r["threads"] for r in rows if r["mode"] == m})
            loads = [r["load"] for r in rows if r["mode"] == m]
            spread = f"{min(speeds[m]):.2f}-{max(speeds[m]):.2f}"
            print(f"{name:<12} {label:<16} {'/'.join(map(str, picked)):>7} {statistics.median(loads):>8.1f} "
                  f"{median[m]:>8.2f} {spread:>13} {median[m] / median['1']:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
