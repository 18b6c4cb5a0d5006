"""`gated-attention quickstart`: the paper's two claims on embedded data, with the project's code paths.

On one corpus (`data.py`: Python's own documentation and standard library),
one tokenizer, one seed and one step budget:

(a) from scratch: a small ungated `GatedAttentionForCausalLM` against the same
    model with the G1 gate (elementwise sigmoid on the SDPA output). Both start
    from the same weights; the gated one has its gate projections on top.
(b) conversion: a small transformers `LlamaForCausalLM` is pretrained on the
    corpus (cached after the first run), converted by `convert_checkpoint`
    (exact init: the logits are checked bit-identical), and then the converted
    model and the unconverted source are both trained further, same steps, same
    batches. Gate parameters train at `--gate-lr`; the rest at `--continue-lr`.

Every model is evaluated on the validation split: perplexity at the training
length, first-token attention share (F-Attn), max activation (M-Act), mean
gate score and fraction of scores below 0.1 (via `gated_attention.analysis`),
and perplexity at `--long-factor` times the training length, without and with
YaRN (`convert.rope.apply_rope_change`). Output, in `--out`: `results.csv`
(the printed table), `training.csv` (loss and gate score per step),
`layers.csv` (per-layer first-token attention and max activation), and
`loss.png`, `gate_score.png`, `first_token_attention.png`, `max_activation.png`
drawn from those files.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import data
from .training import TrainConfig, evaluate_loss, make_optimizer, make_scheduler, train, with_rope

_PRETRAIN_FORMAT = 1  # bump when the source-model recipe changes, so cached sources are not reused


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
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--cache", help="cache folder for the tokenizer and the pretrained source (default: "
                   "$GATED_ATTENTION_CACHE or ~/.cache/gated-attention)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--preset", choices=["sinks"], help="sinks: an ungated and a G1-gated model from the same weights "
                   "on the package corpus, per-layer first-token attention and max activations (gated_attention/sinks.py)")
    p.add_argument("--architecture", choices=["dense", "hybrid"], help="--preset sinks: dense (default) or a Gated "
                   "DeltaNet hybrid 3:1 (then `analyze` runs on both models)")
    p.add_argument("--corpus", choices=list(data.CORPORA), help="--preset sinks: training corpus (default packages: "
                   "the Python sources of this project's dependencies, see data.package_corpus_documents)")
    p.set_defaults(func=run)


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


# ---------------------------------------------------------------------------------------------
# Data and models


@dataclass
class Data:
    tokenizer: object
    train: torch.Tensor  # [N, seq_len]
    valid: torch.Tensor  # [eval_sequences, seq_len]
    valid_long: torch.Tensor  # [<= eval_sequences, long_factor * seq_len]


def load_data(s: Settings, cache: Path | None) -> Data:
    tokenizer = data.load_tokenizer(s.vocab_size, s.max_chars, cache)
    train_stream = data.corpus_tokens(tokenizer, "train", s.max_chars)
    valid_stream = data.corpus_tokens(tokenizer, "validation", s.max_chars)
    bos = tokenizer.bos_token_id
    long_len = s.long_factor * s.seq_len
    valid_long = data.pack(valid_stream, long_len, bos, max_rows=s.eval_sequences)
    if len(valid_long) == 0:
        from .cli import CLIError

        raise CLIError(f"the validation split ({len(valid_stream)} tokens) is shorter than one {long_len}-token sequence")
    return Data(
        tokenizer,
        data.pack(train_stream, s.seq_len, bos),
        data.pack(valid_stream, s.seq_len, bos, max_rows=s.eval_sequences),
        valid_long,
    )


def _shape(s: Settings, tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads, max_position_embeddings=s.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def scratch_models(s: Settings, tokenizer):
    """Ungated and G1-gated models with identical weights apart from the gates."""
    from .configuration.gated_attention import GatedAttentionConfig
    from .modeling.gated_attention import GatedAttentionForCausalLM

    torch.manual_seed(s.seed)
    ungated = GatedAttentionForCausalLM(GatedAttentionConfig(**_shape(s, tokenizer), attn_gate=None))
    torch.manual_seed(s.seed)
    gated = GatedAttentionForCausalLM(GatedAttentionConfig(**_shape(s, tokenizer), attn_gate={"position": "G1"}))
    missing, unexpected = gated.load_state_dict(ungated.state_dict(), strict=False)
    assert not unexpected and all("attn_gate" in k for k in missing), (missing, unexpected)
    return ungated, gated


def _train(model, rows, s: Settings, steps: int, lr: float, seed: int, desc: str, progress: bool) -> list[dict]:
    config = TrainConfig(
        steps=steps, batch_size=s.batch_size, lr=lr, gate_lr=s.gate_lr, seed=seed,
        warmup_steps=max(1, int(s.warmup_fraction * steps)),
    )
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps)
    return train(model, rows, config, optimizer, scheduler, desc=desc, progress=progress)


def pretrained_source(s: Settings, d: Data, cache: Path, progress: bool, log) -> Path:
    """Folder of a `LlamaForCausalLM` pretrained on the corpus for `pretrain_steps`; cached by its recipe."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = _shape(s, d.tokenizer)
    recipe = {
        "format": _PRETRAIN_FORMAT, "shape": shape, "steps": s.pretrain_steps, "lr": s.lr, "batch": s.batch_size,
        "seq_len": s.seq_len, "seed": s.seed, "warmup": s.warmup_fraction,
        "tokenizer": Path(d.tokenizer.name_or_path).name, "torch": torch.__version__.split("+")[0],
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache / "quickstart" / f"llama-{key}"
    if (folder / "recipe.json").exists():
        log(f"source: cached pretrained Llama in {folder}")
        return folder
    log(f"source: pretraining a LlamaForCausalLM for {s.pretrain_steps} steps (cached in {folder})")
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    history = _train(model, d.train, s, s.pretrain_steps, s.lr, s.seed, "pretrain llama", progress)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    d.tokenizer.save_pretrained(tmp)
    (tmp / "history.json").write_text(json.dumps(history), encoding="utf-8")
    (tmp / "recipe.json").write_text(json.dumps(recipe, indent=1), encoding="utf-8")  # written last: the folder is complete
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "recipe.json").exists():
            raise
    return folder


# ---------------------------------------------------------------------------------------------
# Evaluation


def long_context_perplexities(model, s: Settings, d: Data) -> tuple[float, float]:
    """Perplexity at `long_factor * seq_len`: with the trained RoPE, and with YaRN over the training length."""
    from .convert.rope import RopeChange, apply_rope_change

    plain = math.exp(evaluate_loss(model, d.valid_long, s.batch_size))
    change = RopeChange(yarn_factor=float(s.long_factor), original_max_position_embeddings=s.seq_len)
    params, max_pos = apply_rope_change(model.config.rope_parameters, model.config.max_position_embeddings, change)
    yarn = math.exp(evaluate_loss(with_rope(model, params, max_pos), d.valid_long, s.batch_size))
    return plain, yarn


@torch.no_grad()
def analysis_metrics(model, rows: torch.Tensor) -> dict:
    """F-Attn, M-Act and gate statistics (the analysis toolkit's definitions) on validation `rows` `[N, T]`."""
    from .analysis import metrics as M
    from .analysis.capture import Capture

    model.eval()
    first_attention, max_act, gate_scores = [], [], []
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        for x in rows:
            cap.clear()
            model(input_ids=x[None], use_cache=False)
            record = cap.records[-1]
            maps = [record.attentions[f][0].float().numpy() for f in cap.layout.full_attention_layers]  # [H, T, T] each
            first_attention.append(M.first_token_attention(maps).mean(axis=1))  # [n_layers]
            residual = record.residual_stack()[:, 0].float().numpy()  # [L+1, T, D]
            max_act.append(M.m_act_per_layer(residual))  # [L+1]
            gate_scores += [g.float().numpy().ravel() for g in record.gates.values()]
    first_attention, max_act = np.mean(first_attention, axis=0), np.mean(max_act, axis=0)
    gates = M.gate_statistics(np.concatenate(gate_scores) if gate_scores else np.zeros(0))
    return {
        "f_attn": float(first_attention.mean()),
        "m_act": float(max_act[1:].mean()),  # M-Act: decoder layers 1..L, the embeddings excluded
        "gate_mean": gates["mean"],
        "gate_frac_below_0.1": gates["frac_below_0.1"],
        "layers_first_token_attention": first_attention.tolist(),  # one per attention layer
        "layers_max_activation": max_act[1:].tolist(),  # one per decoder layer
    }


# ---------------------------------------------------------------------------------------------
# Output


RESULT_COLUMNS = [
    ("model", "model", "{}"),
    ("steps", "steps", "{}"),
    ("val_ppl", "val ppl", "{:.2f}"),
    ("ppl_long", "ppl@{L}", "{:.2f}"),
    ("ppl_long_yarn", "ppl@{L} YaRN", "{:.2f}"),
    ("f_attn", "F-Attn", "{:.3f}"),
    ("m_act", "M-Act", "{:.1f}"),
    ("gate_mean", "gate", "{:.3f}"),
    ("gate_frac_below_0.1", "gate<0.1", "{:.3f}"),
]


def format_table(rows: list[dict], long_len: int) -> str:
    header = [title.format(L=long_len) for _, title, _ in RESULT_COLUMNS]
    cells = [
        ["-" if isinstance(r[k], float) and math.isnan(r[k]) else fmt.format(r[k]) for k, _, fmt in RESULT_COLUMNS]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def draw_plots(out: Path) -> list[Path]:
    """Draw the PNGs from `training.csv` and `layers.csv` (so they can be redrawn from the files alone)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    training, layers = read_csv(out / "training.csv"), read_csv(out / "layers.csv")
    runs = list(dict.fromkeys(r["model"] for r in training))
    models = list(dict.fromkeys(r["model"] for r in layers))
    written = []

    def series(rows, model, x, y):
        pts = [(float(r[x]), float(r[y])) for r in rows if r["model"] == model and r[y] not in ("", "nan")]
        return [p[0] for p in pts], [p[1] for p in pts]

    def style(model):  # solid: from scratch; dashed: the conversion experiment
        return {"ls": "-" if model.startswith("scratch") else "--"}

    def smooth(values, window):
        if len(values) < window:
            return values
        return np.convolve(values, np.ones(window) / window, mode="valid").tolist()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in runs:
        steps, loss = series(training, model, "step", "loss")
        w = max(1, len(loss) // 30)
        ax.plot(steps[w - 1 :], smooth(loss, w), label=model, **style(model))
    ax.set(xlabel="step", ylabel="training loss (nats, moving mean)", title="Training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "loss.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in runs:
        steps, gate = series(training, model, "step", "gate_score")
        if gate:
            ax.plot(steps, gate, label=model, **style(model))
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel="mean gate score (training batches)", title="Gate score during training")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "gate_score.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for column, name, ylabel in (
        ("first_token_attention", "first_token_attention.png", "attention on the first token (mean over heads, queries)"),
        ("max_activation", "max_activation.png", "max |hidden| (layer output)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for model in models:
            layer, value = series(layers, model, "layer", column)
            ax.plot(layer, value, marker="o", label=model, **style(model))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="layer (1-based)", ylabel=ylabel, title=ylabel.split(" (")[0].capitalize() + " per layer")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


# ---------------------------------------------------------------------------------------------
# The job


def run(args: argparse.Namespace) -> int:
    from .convert.convert import convert_checkpoint
    from .modeling.gated_attention import GatedAttentionForCausalLM
    from transformers import LlamaForCausalLM

    if getattr(args, "preset", None) == "sinks":
        from .sinks import run as run_sinks

        return run_sinks(args)
    s = settings_from_args(args)
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = Path(args.cache).expanduser() if args.cache else data.cache_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = print
    t_start = time.perf_counter()
    (out / "settings.json").write_text(json.dumps(asdict(s), indent=1), encoding="utf-8")

    log(f"data: embedded corpus, BPE vocabulary {s.vocab_size} (tokenizer cached under {cache})")
    d = load_data(s, cache)
    log(f"data: {d.train.numel():,} training tokens in {len(d.train)} sequences of {s.seq_len} (BOS first); "
        f"validation {len(d.valid)} x {s.seq_len} and {len(d.valid_long)} x {s.long_factor * s.seq_len}")

    runs: dict[str, dict] = {}  # name -> {"model", "history", "steps"}

    # (a) from scratch
    ungated, gated = scratch_models(s, d.tokenizer)
    for name, model in (("scratch, no gate", ungated), ("scratch, G1 gate", gated)):
        history = _train(model, d.train, s, s.steps, s.lr, s.seed, name, progress)
        runs[name] = {"model": model, "history": history, "steps": s.steps}

    # (b) conversion
    source_dir = pretrained_source(s, d, cache, progress, log)
    converted_dir = out / "converted"
    result = convert_checkpoint(str(source_dir), converted_dir, gate="elementwise", init="exact", overwrite=True,
                                log=lambda msg: log(f"convert: {msg}"))
    source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    converted = GatedAttentionForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = source(input_ids=d.valid).logits, converted(input_ids=d.valid).logits
    exact = torch.equal(a, b)
    log(f"convert: validation logits of source and converted model {'are bit-identical' if exact else 'DIFFER'} "
        f"(max |diff| {(a - b).abs().max().item():g}; converter's own check {result.max_abs_diff:g})")
    if not exact:
        raise RuntimeError("exact conversion changed the logits")
    runs["Llama source (pretrained)"] = {"model": copy.deepcopy(source), "history": [], "steps": s.pretrain_steps}
    gate_before = {n: p.detach().clone() for n, p in converted.named_parameters() if "attn_gate" in n}
    for name, model in (("Llama source + continued", source), ("converted + continued", converted)):
        history = _train(model, d.train, s, s.steps, s.continue_lr, s.seed + 1, name, progress)
        runs[name] = {"model": model, "history": history, "steps": s.pretrain_steps + s.steps}
    moved = max((p.detach() - gate_before[n]).abs().max().item() for n, p in converted.named_parameters() if n in gate_before)

    # evaluation
    results, layer_rows, training_rows = [], [], []
    for name, r in runs.items():
        log(f"evaluating: {name}")
        model = r["model"].eval()
        row = {"model": name, "steps": r["steps"], "val_ppl": math.exp(evaluate_loss(model, d.valid, s.batch_size))}
        row["ppl_long"], row["ppl_long_yarn"] = long_context_perplexities(model, s, d)
        metrics = analysis_metrics(model, d.valid[: s.analysis_sequences])
        row.update({k: v for k, v in metrics.items() if not k.startswith("layers_")})
        results.append(row)
        for l, (fa, ma) in enumerate(zip(metrics["layers_first_token_attention"], metrics["layers_max_activation"]), 1):
            layer_rows.append({"model": name, "layer": l, "first_token_attention": fa, "max_activation": ma})
        training_rows += [{"model": name, **h} for h in r["history"]]

    write_csv(out / "results.csv", results, [k for k, _, _ in RESULT_COLUMNS])
    write_csv(out / "training.csv", training_rows, ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"])
    write_csv(out / "layers.csv", layer_rows, ["model", "layer", "first_token_attention", "max_activation"])
    plots = draw_plots(out)

    converted_hist = runs["converted + continued"]["history"]
    log("")
    log(format_table(results, s.long_factor * s.seq_len))
    log("")
    log(f"converted gates: mean score 0.500 at conversion (exact init) -> {results[-1]['gate_mean']:.3f} after "
        f"{s.steps} steps at gate lr {s.gate_lr:g} (other parameters {s.continue_lr:g}); largest change of a gate "
        f"parameter {moved:.3g}; training-batch gate score at the last step {converted_hist[-1]['gate_score']:.3f}")
    log(f"wrote {out / 'results.csv'}, training.csv, layers.csv, {', '.join(p.name for p in plots)} "
        f"({(time.perf_counter() - t_start) / 60:.1f} min)")
    return 0
