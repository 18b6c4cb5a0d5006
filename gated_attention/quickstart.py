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

`--device auto` trains on CUDA when torch sees a GPU (`choose_device`): training
forwards under bf16 autocast, fp32 parameters, fp32 evaluation.
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
from .quickstart_cli import SMOKE, Settings, settings_from_args  # noqa: F401 - the parser and the settings
from .training import TrainConfig, evaluate_loss, make_optimizer, make_scheduler, train, with_rope

_PRETRAIN_FORMAT = 1  # bump when the source-model recipe changes, so cached sources are not reused


# ---------------------------------------------------------------------------------------------
# Device


@dataclass(frozen=True)
class Placement:
    """Where the job runs: parameters are fp32 everywhere; on a GPU the training forwards run under bf16 autocast.

    Evaluation always runs in fp32, so every column of the table measures the same fp32 model on any device.
    """

    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32

    def describe(self) -> str:
        if self.autocast_dtype is None:
            return f"{self.device.type} (fp32)"
        return f"{self.device.type} (training under {str(self.autocast_dtype).removeprefix('torch.')} autocast, fp32 parameters; fp32 evaluation)"


def choose_device(requested: str) -> Placement:
    """`--device auto|cpu|cuda`: auto is cuda when torch sees a GPU; cuda trains under bf16 autocast."""
    from .cli import CLIError

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return Placement(torch.device("cpu"), None)
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False); use --device cpu")
        return Placement(torch.device("cuda"), torch.bfloat16)
    raise CLIError(f"--device {requested!r}: choose auto, cpu or cuda")


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


def _train(model, rows, s: Settings, steps: int, lr: float, seed: int, desc: str, progress: bool,
           placement: Placement) -> list[dict]:
    """Train `model` (moved to the placement's device first) with the quickstart recipe."""
    model.to(placement.device)
    config = TrainConfig(
        steps=steps, batch_size=s.batch_size, lr=lr, gate_lr=s.gate_lr, seed=seed,
        warmup_steps=max(1, int(s.warmup_fraction * steps)), autocast_dtype=placement.autocast_dtype,
    )
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps)
    return train(model, rows, config, optimizer, scheduler, desc=desc, progress=progress)


def pretrained_source(s: Settings, d: Data, cache: Path, progress: bool, log, placement: Placement) -> Path:
    """Folder of a `LlamaForCausalLM` pretrained on the corpus for `pretrain_steps`; cached by its recipe."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = _shape(s, d.tokenizer)
    recipe = {
        "format": _PRETRAIN_FORMAT, "shape": shape, "steps": s.pretrain_steps, "lr": s.lr, "batch": s.batch_size,
        "seq_len": s.seq_len, "seed": s.seed, "warmup": s.warmup_fraction,
        "tokenizer": Path(d.tokenizer.name_or_path).name, "torch": torch.__version__.split("+")[0],
    }
    if placement.autocast_dtype is not None:  # other numbers than the fp32 recipe (whose key stays as it was)
        recipe["autocast"] = str(placement.autocast_dtype).removeprefix("torch.")
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache / "quickstart" / f"llama-{key}"
    if (folder / "recipe.json").exists():
        log(f"source: cached pretrained Llama in {folder}")
        return folder
    log(f"source: pretraining a LlamaForCausalLM for {s.pretrain_steps} steps (cached in {folder})")
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    history = _train(model, d.train, s, s.pretrain_steps, s.lr, s.seed, "pretrain llama", progress, placement)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.cpu().save_pretrained(tmp)
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
    device = next(model.parameters()).device
    first_attention, max_act, gate_scores = [], [], []
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        for x in rows:
            cap.clear()
            model(input_ids=x[None].to(device), use_cache=False)
            record = cap.records[-1]
            maps = [record.attentions[f][0].float().cpu().numpy() for f in cap.layout.full_attention_layers]  # [H, T, T] each
            first_attention.append(M.first_token_attention(maps).mean(axis=1))  # [n_layers]
            residual = record.residual_stack()[:, 0].float().cpu().numpy()  # [L+1, T, D]
            max_act.append(M.m_act_per_layer(residual))  # [L+1]
            gate_scores += [g.float().cpu().numpy().ravel() for g in record.gates.values()]
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
    return format_columns(rows, [(key, title.format(L=long_len), fmt) for key, title, fmt in RESULT_COLUMNS])


def format_columns(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table: `columns` are (key, title, format); NaN prints as "-"; first column left-aligned."""
    header = [title for _, title, _ in columns]
    cells = [
        ["-" if isinstance(r[k], float) and math.isnan(r[k]) else fmt.format(r[k]) for k, _, fmt in columns]
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


def save_figure(fig, path: Path) -> Path:
    """Tight layout, 120 dpi, figure closed (every plot of quickstart and the sinks preset); returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    written.append(save_figure(fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in runs:
        steps, gate = series(training, model, "step", "gate_score")
        if gate:
            ax.plot(steps, gate, label=model, **style(model))
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel="mean gate score (training batches)", title="Gate score during training")
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "gate_score.png"))

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
        written.append(save_figure(fig, out / name))
    return written


# ---------------------------------------------------------------------------------------------
# The job


def run(args: argparse.Namespace) -> int:
    from .convert.convert import VERIFY_ATTENTION, convert_checkpoint
    from .modeling.gated_attention import GatedAttentionForCausalLM
    from transformers import LlamaForCausalLM

    if getattr(args, "preset", None) == "sinks":
        from .sinks import run as run_sinks

        return run_sinks(args)
    s = settings_from_args(args)
    placement = choose_device(getattr(args, "device", "auto"))
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = Path(args.cache).expanduser() if args.cache else data.cache_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = print
    t_start = time.perf_counter()
    autocast = None if placement.autocast_dtype is None else str(placement.autocast_dtype).removeprefix("torch.")
    run_info = {"device": placement.device.type, "autocast": autocast}
    (out / "settings.json").write_text(json.dumps({**asdict(s), **run_info}, indent=1), encoding="utf-8")
    log(f"device: {placement.describe()}")

    log(f"data: embedded corpus, BPE vocabulary {s.vocab_size} (tokenizer cached under {cache})")
    d = load_data(s, cache)
    log(f"data: {d.train.numel():,} training tokens in {len(d.train)} sequences of {s.seq_len} (BOS first); "
        f"validation {len(d.valid)} x {s.seq_len} and {len(d.valid_long)} x {s.long_factor * s.seq_len}")

    runs: dict[str, dict] = {}  # name -> {"model", "history", "steps"}

    # (a) from scratch
    ungated, gated = scratch_models(s, d.tokenizer)
    for name, model in (("scratch, no gate", ungated), ("scratch, G1 gate", gated)):
        history = _train(model, d.train, s, s.steps, s.lr, s.seed, name, progress, placement)
        runs[name] = {"model": model, "history": history, "steps": s.steps}

    # (b) conversion
    source_dir = pretrained_source(s, d, cache, progress, log, placement)
    converted_dir = out / "converted"
    result = convert_checkpoint(str(source_dir), converted_dir, gate="elementwise", init="exact", overwrite=True,
                                log=lambda msg: log(f"convert: {msg}"))
    # The exactness check compares like with like: both models on the CPU, in fp32, through transformers'
    # SDPA (on a CUDA machine our model would otherwise default to the fused kernel), as the converter's own
    # check does. They train on `placement` afterwards with these same weights.
    source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32, attn_implementation=VERIFY_ATTENTION).eval()
    converted = GatedAttentionForCausalLM.from_pretrained(
        converted_dir, dtype=torch.float32, attn_implementation=VERIFY_ATTENTION).eval()
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
        history = _train(model, d.train, s, s.steps, s.continue_lr, s.seed + 1, name, progress, placement)
        runs[name] = {"model": model, "history": history, "steps": s.pretrain_steps + s.steps}
    moved = max((p.detach() - gate_before[n].to(p.device)).abs().max().item()
                for n, p in converted.named_parameters() if n in gate_before)

    # evaluation
    results, layer_rows, training_rows = [], [], []
    for name, r in runs.items():
        log(f"evaluating: {name}")
        model = r["model"].to(placement.device).eval()
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
