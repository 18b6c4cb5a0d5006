"""Does the G1 gate make a model easier or harder to quantize? The quickstart pair, from scratch, under every
scheme and arm of `analyze --quantization`.

The ungated `GatedAttentionForCausalLM` and its G1 twin are built as `gated-attention quickstart` builds them
(`recipes.common.model_pair`: the same weights apart from the gates), trained on the same batches of the
embedded corpus with quickstart's recipe (its `Settings`: AdamW, warmup, gate learning rate), then measured
on the same validation sequences by `quantization.measure` (round-to-nearest, min-max scales): perplexity, KL
from the model's own unquantized distribution and top-1 agreement per arm, and the outlier statistics of the
layers' inputs. It prints one table and writes `quantization.csv` and `quantization_layers.csv` (a `model`
column first) to --out.

Usage: python benchmarks/quantization_pairs.py [--steps 200] [--schemes W8A8 W4A16 FP8 NVFP4 MXFP4] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.quantization import measure
from gated_attention.recipes.common import model_pair
from gated_attention.recipes.quickstart import load_data
from gated_attention.recipes.settings import Settings
from gated_attention.training import TrainConfig, make_optimizer, make_scheduler, train

SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4", "MXFP4")


def _train(model, rows, s: Settings) -> None:
    config = TrainConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, gate_lr=s.gate_lr, seed=s.seed,
                         warmup_steps=max(1, int(s.warmup_fraction * s.steps)))
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    train(model, rows, config, optimizer, make_scheduler(optimizer, config.steps, config.warmup_steps), desc="train")


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=bounded(int, 1), default=Settings().steps, help="training steps (default: %(default)s)")
    parser.add_argument("--eval-sequences", type=bounded(int, 1), default=16,
                        help="validation sequences measured (default: %(default)s)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), help="compressed-tensors presets (default: %(default)s)")
    parser.add_argument("--out", default="quantization_pairs", help="output folder (default: %(default)s)")
    args = parser.parse_args()

    s = Settings(steps=args.steps)
    torch.manual_seed(s.seed)
    d = load_data(s, None)
    inputs = [row[None] for row in d.valid[: args.eval_sequences]]
    results, layers = [], []
    for name, model in zip(("ungated", "G1"), model_pair(s, d.tokenizer)):
        _train(model, d.train, s)
        model.eval()
        _, rows = measure.measure(model, inputs, args.schemes)
        results += [{"model": name, **row} for row in rows]
        layers += [{"model": name, **row} for row in measure.outliers(model, inputs)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "quantization.csv", results)
    _write(out / "quantization_layers.csv", layers)

    print(f"quickstart pair, {s.steps} steps from the same init; {len(inputs)} validation sequences of {s.seq_len} tokens")
    by = {(r["model"], r["scheme"], r["arm"]): r for r in results}
    print(f"{'scheme':<7} {'arm':<11} {'ppl ungated':>11} {'ppl G1':>8} {'KL ungated':>11} {'KL G1':>9} {'G1/ungated':>10}")
    for (model, scheme, arm), row in by.items():
        if model != "G1":
            continue
        other = by.get(("ungated", scheme, arm))
        ungated_kl = f"{other['kl']:.3g}" if other else "-"
        ratio = f"{row['kl'] / other['kl']:.2f}" if other and other["kl"] else "-"
        ungated_ppl = f"{other['perplexity']:.2f}" if other else "-"
        print(f"{scheme:<7} {arm:<11} {ungated_ppl:>11} {row['perplexity']:>8.2f} {ungated_kl:>11} {row['kl']:>9.3g} {ratio:>10}")
    for kind in dict.fromkeys(r["kind"] for r in layers):
        means = {m: statistics.mean(r["kurtosis"] for r in layers if r["kind"] == kind and r["model"] == m)
                 for m in ("ungated", "G1") if any(r["kind"] == kind and r["model"] == m for r in layers)}
        print(f"input kurtosis of {kind}, mean over layers: " + ", ".join(f"{m} {v:.3g}" for m, v in means.items()))
    print(f"wrote {out / 'quantization.csv'}")


if __name__ == "__main__":
    main()
