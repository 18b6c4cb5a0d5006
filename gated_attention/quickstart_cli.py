"""`gated-attention quickstart`: its parser and settings (the job itself is `gated_attention.quickstart`).

Kept apart from the job so that building the parser imports no torch: the
command imports `quickstart` when it runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# gated_attention.data.CORPORA, spelled out so that building the parser imports nothing heavy (tests/test_sinks.py checks)
CORPORA = ("embedded", "packages")

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Settings:
    """Everything that decides the numbers; `--smoke` and the flags only change these."""

    vocab_size: int = 1024
    max_chars: int | None = None  # corpus prefix; None = all of it
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 200  # from scratch, and continued training after conversion
    pretrain_steps: int = 200  # the Llama source
    lr: float = 1e-3  # from scratch and for pretraining the source
    continue_lr: float = 3e-4  # continued training of the source and the converted model (non-gate parameters)
    gate_lr: float = 1e-3  # gate parameters, in every run
    warmup_fraction: float = 0.1
    long_factor: int = 4  # evaluate at long_factor * seq_len, without and with YaRN
    eval_sequences: int = 64  # validation sequences for perplexity (at each length)
    analysis_sequences: int = 8  # validation sequences for F-Attn, M-Act and gate statistics
    seed: int = 0


SMOKE = dict(
    vocab_size=300, max_chars=150_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, seq_len=32, batch_size=4, steps=4, pretrain_steps=4, long_factor=2,
    eval_sequences=4, analysis_sequences=2,
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
                   "on the package corpus, per-layer first-token attention and max activations (gated_attention/sinks.py)")
    p.add_argument("--architecture", choices=["dense", "hybrid"], help="--preset sinks: dense (default) or a Gated "
                   "DeltaNet hybrid 3:1 (then `analyze` runs on both models)")
    p.add_argument("--corpus", choices=CORPORA, help="--preset sinks: training corpus (default packages: "
                   "the Python sources of this project's dependencies, see data.package_corpus_documents)")
    p.add_argument("--weight-decay", type=float, help="--preset sinks: AdamW weight decay of the weight matrices "
                   "(default 0.1; 1.0 with --layers 12 gives the first token the largest activations, see README)")
    p.set_defaults(func=_run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    s = Settings(**(SMOKE if args.smoke else {}))
    for name in ("steps", "pretrain_steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size", "lr", "continue_lr", "gate_lr", "long_factor",
                 "eval_sequences", "seed"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(s, name, value)
    if args.hidden_size is not None:
        s.intermediate_size = 3 * s.hidden_size
    from .cli import CLIError

    if s.hidden_size % s.num_attention_heads:
        raise CLIError(f"--hidden-size {s.hidden_size} is not a multiple of --heads {s.num_attention_heads}")
    if min(s.steps, s.pretrain_steps, s.batch_size, s.eval_sequences) < 1 or s.seq_len < 8 or s.long_factor < 2:
        raise CLIError("--steps, --pretrain-steps, --batch-size, --eval-sequences must be >= 1, --seq-len >= 8, "
                       "--long-factor >= 2")
    return s




def _run(args: argparse.Namespace) -> int:
    from .quickstart import run

    return run(args)
