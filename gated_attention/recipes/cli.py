"""`gated-attention quickstart`: its parser, and the dispatch to the recipe it asks for.

Building the parser imports no torch (the defaults come from `settings`); `run`
imports the recipe when the command runs.
"""

from __future__ import annotations

import argparse

from .settings import ARCHITECTURES, CORPORA, DEVICES, Settings


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
    d = Settings()
    p.add_argument("--out", default="quickstart_out", help="output folder (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="tiny models and a few steps, for tests (seconds)")
    p.add_argument("--steps", type=int, help=f"training steps from scratch and after conversion (default {d.steps})")
    p.add_argument("--pretrain-steps", type=int, help=f"steps of the Llama source (default {d.pretrain_steps})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {d.batch_size})")
    p.add_argument("--seq-len", type=int, help=f"training length in tokens, BOS included (default {d.seq_len})")
    p.add_argument("--hidden-size", type=int, help=f"(default {d.hidden_size}; intermediate size is 3x)")
    p.add_argument("--layers", type=int, dest="num_hidden_layers", help=f"(default {d.num_hidden_layers})")
    p.add_argument("--heads", type=int, dest="num_attention_heads", help=f"(default {d.num_attention_heads})")
    p.add_argument("--vocab-size", type=int, help=f"BPE vocabulary (default {d.vocab_size})")
    p.add_argument("--lr", type=float, help=f"learning rate from scratch and for the source (default {d.lr:g})")
    p.add_argument("--continue-lr", type=float, help=f"non-gate learning rate after conversion (default {d.continue_lr:g})")
    p.add_argument("--gate-lr", type=float, help=f"learning rate of gate parameters (default {d.gate_lr:g})")
    p.add_argument("--long-factor", type=int, help=f"evaluate at this multiple of --seq-len (default {d.long_factor})")
    p.add_argument("--eval-sequences", type=int, help=f"validation sequences for perplexity (default {d.eval_sequences})")
    p.add_argument("--seed", type=int, help=f"(default {d.seed})")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to train and evaluate: auto (default) = cuda when torch sees a GPU, else cpu. On cuda, "
                   "training runs under bf16 autocast with fp32 parameters; evaluation runs in fp32")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--cache", help="cache folder for the tokenizer and the pretrained source (default: "
                   "$GATED_ATTENTION_CACHE or ~/.cache/gated-attention)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--preset", choices=["sinks"], help="sinks: an ungated and a G1-gated model from the same weights "
                   "on the package corpus, per-layer first-token attention and max activations "
                   "(gated_attention/recipes/sinks.py)")
    p.add_argument("--architecture", choices=ARCHITECTURES, help="--preset sinks: dense (default) or a Gated "
                   "DeltaNet hybrid 3:1 (then `analyze` runs on both models)")
    p.add_argument("--corpus", choices=CORPORA, help="--preset sinks: training corpus (default packages: "
                   "the Python sources of this project's dependencies, see training.data.package_corpus_documents)")
    p.add_argument("--weight-decay", type=float, help="--preset sinks: AdamW weight decay of the weight matrices "
                   "(default 0.1; 1.0 with --layers 12 gives the first token the largest activations, see README)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the recipe `args` ask for: the sinks preset, or quickstart's main job."""
    if getattr(args, "preset", None) == "sinks":
        from .sinks import run as recipe
    else:
        from .quickstart import run as recipe
    return recipe(args)
