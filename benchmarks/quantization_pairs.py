"""Does the G1 gate make a model easier or harder to quantize? A pair from scratch, ungated and G1, under
every scheme and arm of `analyze --quantization`.

`--pair quickstart` (the default): the ungated `GatedAttentionForCausalLM` and its G1 twin as `gated-attention
quickstart` builds them (`recipes.common.model_pair`: the same weights apart from the gates), trained on the same
batches of the embedded corpus with quickstart's recipe (its `Settings`: AdamW, warmup, cosine, gate learning
rate), measured on its validation sequences. `--pair backcopy`: the control and G1 of `quickstart --preset
backcopy` (`BackcopySettings`: 1 layer, width 64, Bigram-Backcopy; the control grows a first-token sink, G1 does
not), trained as that preset trains them (constant rate after warmup), measured on its held-out sequences. A
scheme whose groups do not tile the pair's widths (W4A16's 128 on width 64) is left out with one line.
`--pair hybrid`: quickstart's data and recipe on its 3:1 Gated DeltaNet hybrid, q/k norms in both arms; the
trained G1 hybrid is also exported to transformers' native Qwen3.5 (`gated-attention export --format qwen3_5`)
and measured there, where the gate is rows of `q_proj` (the arms `gate_rows_only` and `query_rows_only`).

Each model is measured by `quantization.measure` (round-to-nearest, min-max scales): perplexity, KL from the
model's own unquantized distribution and top-1 agreement per arm, and the outlier statistics of the layers'
inputs. It prints one table and writes `quantization.csv` and `quantization_layers.csv` (a `model` column
first) to --out.

Usage: python benchmarks/quantization_pairs.py [--pair quickstart|backcopy|hybrid] [--steps N]
       [--schemes W8A8 W4A16 FP8 NVFP4 MXFP4] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

import torch

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.quantization import measure
from gated_attention.quantization.schemes import QuantizationError
from gated_attention.recipes.backcopy_task import BackcopyTask
from gated_attention.recipes.common import model_arms, model_pair
from gated_attention.recipes.quickstart import load_data
from gated_attention.recipes.settings import BackcopySettings, Settings
from gated_attention.training import TrainConfig, make_optimizer, make_scheduler, train

SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4", "MXFP4")


def _train(model, rows, s, min_ratio: float) -> None:
    decay = {"weight_decay": s.weight_decay} if hasattr(s, "weight_decay") else {}  # quickstart keeps TrainConfig's
    config = TrainConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, gate_lr=s.gate_lr, seed=s.seed,
                         warmup_steps=max(1, int(s.warmup_fraction * s.steps)), **decay)
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps, min_ratio)
    train(model, rows, config, optimizer, scheduler, desc="train")


def _quickstart_data(steps: int | None, n_eval: int):
    s = Settings() if steps is None else Settings(steps=steps)
    torch.manual_seed(s.seed)
    d = load_data(s, None)
    return s, d, [row[None] for row in d.valid[:n_eval]]


def quickstart_pair(steps: int | None, n_eval: int):
    """(settings, {name: model}, training rows, validation inputs, the schedule's final rate ratio)."""
    s, d, inputs = _quickstart_data(steps, n_eval)
    ungated, gated = model_pair(s, d.tokenizer)
    return s, {"ungated": ungated, "G1": gated}, d.train, inputs, 0.1


def backcopy_pair(steps: int | None, n_eval: int):
    s = BackcopySettings() if steps is None else BackcopySettings(steps=steps)
    task = BackcopyTask(n_tokens=s.n_tokens, n_triggers=s.n_triggers, successors=s.successors,
                        trigger_prob=s.trigger_prob, seed=s.seed)
    train_rows, valid = task.sample(s.train_sequences, s.seq_len, seed=1), task.sample(n_eval, s.seq_len, seed=2)
    models = model_arms(s, task, {"ungated": {"attn_gate": None}, "G1": {"attn_gate": {"position": "G1"}}})
    return s, models, train_rows, [row[None] for row in valid], s.lr_min_ratio


def hybrid_pair(steps: int | None, n_eval: int):
    """quickstart's data and recipe on its 3:1 Gated DeltaNet hybrid (`--architecture hybrid`), q/k norms on in both
    arms, as Qwen3.5 has them: the G1 arm exports to transformers' native Qwen3.5 (`export_native`)."""
    s, d, inputs = _quickstart_data(steps, n_eval)
    models = model_arms(s, d.tokenizer, {"ungated": {"attn_gate": None, "qk_norm": True},
                                         "G1": {"attn_gate": {"position": "G1"}, "qk_norm": True}}, "hybrid")
    models["G1"].tokenizer = d.tokenizer  # for the export
    return s, models, d.train, inputs, 0.1


def export_native(model, work: Path):
    """`model` as `gated-attention export --format qwen3_5` writes it (verified there), loaded back by transformers:
    Qwen3.5's layout, the gate as the second half of each head's rows of `q_proj`."""
    from transformers import AutoModelForCausalLM

    from gated_attention.convert.export import export_checkpoint

    model.save_pretrained(work / "G1")
    model.tokenizer.save_pretrained(work / "G1")
    export_checkpoint(str(work / "G1"), work / "G1-qwen3_5", log=lambda *_: None)
    return AutoModelForCausalLM.from_pretrained(work / "G1-qwen3_5", dtype=torch.float32).eval()


PAIRS = {"quickstart": quickstart_pair, "backcopy": backcopy_pair, "hybrid": hybrid_pair}


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=list(PAIRS), default="quickstart", help="which pair (default: %(default)s)")
    parser.add_argument("--steps", type=bounded(int, 1), help="training steps (default: the preset's: quickstart "
                        f"{Settings().steps}, backcopy {BackcopySettings().steps})")
    parser.add_argument("--eval-sequences", type=bounded(int, 1), default=16,
                        help="validation sequences measured (default: %(default)s)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), help="compressed-tensors presets (default: %(default)s)")
    parser.add_argument("--out", default="quantization_pairs", help="output folder (default: %(default)s)")
    args = parser.parse_args()

    s, models, train_rows, inputs, min_ratio = PAIRS[args.pair](args.steps, args.eval_sequences)
    schemes = []
    for name in args.schemes:
        try:
            schemes += measure.check_schemes(models["G1"], [name])
        except QuantizationError as e:
            print(f"left out: {e}")
    results, layers = [], []
    for name, model in models.items():
        _train(model, train_rows, s, min_ratio)
        model.eval()
        measured = {name: model}
        if args.pair == "hybrid" and name == "G1":
            with tempfile.TemporaryDirectory(prefix="quantization-pairs-") as work:
                measured["G1 Qwen3.5 export"] = export_native(model, Path(work))
        for label, m in measured.items():
            _, rows = measure.measure(m, inputs, schemes)
            results += [{"model": label, **row} for row in rows]
            layers += [{"model": label, **row} for row in measure.outliers(m, inputs)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "quantization.csv", results)
    _write(out / "quantization_layers.csv", layers)

    print(f"{args.pair} pair, {s.steps} steps from the same init; {len(inputs)} held-out sequences of {s.seq_len} tokens")
    by = {(r["model"], r["scheme"], r["arm"]): r for r in results}
    print(f"{'model':<17} {'scheme':<7} {'arm':<15} {'ppl ungated':>11} {'ppl':>8} {'KL ungated':>11} {'KL':>9} "
          f"{'/ ungated':>9}")
    for (model, scheme, arm), row in by.items():
        if model == "ungated":
            continue
        other = by.get(("ungated", scheme, arm))
        ungated_kl = f"{other['kl']:.3g}" if other else "-"
        ratio = f"{row['kl'] / other['kl']:.2f}" if other and other["kl"] else "-"
        ungated_ppl = f"{other['perplexity']:.2f}" if other else "-"
        print(f"{model:<17} {scheme:<7} {arm:<15} {ungated_ppl:>11} {row['perplexity']:>8.2f} {ungated_kl:>11} "
              f"{row['kl']:>9.3g} {ratio:>9}")
    for kind in dict.fromkeys(r["kind"] for r in layers):
        means = {m: statistics.mean(r["kurtosis"] for r in layers if r["kind"] == kind and r["model"] == m)
                 for m in dict.fromkeys(r["model"] for r in layers) if any(r["kind"] == kind and r["model"] == m for r in layers)}
        print(f"input kurtosis of {kind}, mean over layers: " + ", ".join(f"{m} {v:.3g}" for m, v in means.items()))
    print(f"wrote {out / 'quantization.csv'}")


if __name__ == "__main__":
    main()
