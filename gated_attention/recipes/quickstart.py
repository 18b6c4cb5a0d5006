"""`gated-attention quickstart`: the paper's two claims on embedded data, with the project's code paths.

On one corpus (`training.data`: Python's own documentation and standard
library), one tokenizer, one seed and one step budget:

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
(the printed table), `training.csv` (loss and gate score per step, counted
over each model's whole training: the continued runs start after the source's
last step),
`layers.csv` (per-layer first-token attention and max activation), and
`loss.png`, `gate_score.png`, `first_token_attention.png`, `max_activation.png`
drawn from those files (`report.draw_quickstart`).

`--device auto` trains on CUDA when torch sees a GPU (`common.choose_device`):
training forwards under bf16 autocast, fp32 parameters, fp32 evaluation.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import CLIError
from ..training import data, evaluate_loss, gate_parameters_snapshot, with_rope
from .common import Data, Job, model_pair, model_shape, train_config, train_with_probes
from .report import GATE_FRACTION, columns_of, draw_quickstart, format_columns, write_csv
from .settings import Settings

_PRETRAIN_FORMAT = 1  # bump when the source-model recipe changes, so cached sources are not reused


def run(args: argparse.Namespace, s: Settings) -> int:
    """The recipe with settings `s` (`settings.settings_from_args(args)`); `args` give where and how it runs."""
    with Job.start(args, asdict(s)) as job:
        d = prepare_data(s, job)
        runs = train_from_scratch(s, d, job)  # (a)
        conversion = convert_and_continue(s, d, job)  # (b)
        runs.update(conversion.runs)
        results, layer_rows, training_rows = measure(runs, s, d, job)
        report(results, layer_rows, training_rows, conversion, s, job)
    return 0


# ---------------------------------------------------------------------------------------------
# Data


def load_data(s: Settings, cache: Path | None) -> Data:
    tokenizer = data.load_tokenizer(s.vocab_size, s.max_chars, cache)
    train_stream = data.corpus_tokens(tokenizer, "train", s.max_chars)
    valid_stream = data.corpus_tokens(tokenizer, "validation", s.max_chars)
    bos = tokenizer.bos_token_id
    long_len = s.long_factor * s.seq_len
    valid_long = data.pack(valid_stream, long_len, bos, max_rows=s.eval_sequences)
    if len(valid_long) == 0:
        raise CLIError(f"the validation split ({len(valid_stream)} tokens) is shorter than one {long_len}-token sequence")
    return Data(
        tokenizer,
        data.pack(train_stream, s.seq_len, bos),
        data.pack(valid_stream, s.seq_len, bos, max_rows=s.eval_sequences),
        valid_long,
    )


def prepare_data(s: Settings, job: Job) -> Data:
    job.log(f"data: embedded corpus, BPE vocabulary {s.vocab_size} (tokenizer cached under {job.cache})")
    d = load_data(s, job.cache)
    job.log(f"data: {d.train.numel():,} training tokens in {len(d.train)} sequences of {s.seq_len} (BOS first); "
            f"validation {len(d.valid)} x {s.seq_len} and {len(d.valid_long)} x {s.long_factor * s.seq_len}")
    return d


# ---------------------------------------------------------------------------------------------
# Training


def _train(model, rows, s: Settings, steps: int, lr: float, seed: int, desc: str, job: Job) -> list[dict]:
    """Train `model` (moved to the job's device first) with the shared loop, no probes: its per-step history."""
    model.to(job.placement.device)
    config = train_config(s, job, steps=steps, lr=lr, seed=seed)
    return train_with_probes(model, desc, rows, config, job, lambda step, loss, minutes: [], every=0).history


def train_from_scratch(s: Settings, d: Data, job: Job) -> dict[str, dict]:
    """(a): the ungated model and its G1-gated twin, same initial weights, same batches."""
    runs = {}
    ungated, gated = model_pair(s, d.tokenizer)
    for name, model in (("scratch, no gate", ungated), ("scratch, G1 gate", gated)):
        history = _train(model, d.train, s, s.steps, s.lr, s.seed, name, job)
        runs[name] = {"model": model, "history": history, "steps": s.steps}
    return runs


def pretrained_source(s: Settings, d: Data, job: Job) -> Path:
    """Folder of a `LlamaForCausalLM` pretrained on the corpus for `pretrain_steps`; cached by its recipe."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = model_shape(s, d.tokenizer)
    recipe = {
        "format": _PRETRAIN_FORMAT, "shape": shape, "steps": s.pretrain_steps, "lr": s.lr, "batch": s.batch_size,
        "seq_len": s.seq_len, "seed": s.seed, "warmup": s.warmup_fraction,
        "tokenizer": Path(d.tokenizer.name_or_path).name, "torch": torch.__version__.split("+")[0],
    }
    if job.placement.autocast_dtype is not None:  # other numbers than the fp32 recipe (whose key stays as it was)
        recipe["autocast"] = str(job.placement.autocast_dtype).removeprefix("torch.")
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    folder = job.cache / "quickstart" / f"llama-{key}"
    if (folder / "recipe.json").exists():
        job.log(f"source: cached pretrained Llama in {folder}")
        return folder
    job.log(f"source: pretraining a LlamaForCausalLM for {s.pretrain_steps} steps (cached in {folder})")
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    history = _train(model, d.train, s, s.pretrain_steps, s.lr, s.seed, "pretrain llama", job)
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


@dataclass
class Conversion:
    runs: dict[str, dict]  # the pretrained source, and source and converted model after continued training
    gate_moved: float  # largest change of a gate parameter during continued training


def convert_and_continue(s: Settings, d: Data, job: Job) -> Conversion:
    """(b): pretrain (or reuse) the Llama source, convert it exactly, check the logits, train both further."""
    from transformers import LlamaForCausalLM

    from ..convert.convert import VERIFY_ATTENTION, convert_checkpoint
    from ..modeling.gated_attention import GatedAttentionForCausalLM

    source_dir = pretrained_source(s, d, job)
    converted_dir = job.folder / "converted"
    result = convert_checkpoint(str(source_dir), converted_dir, gate="elementwise", init="exact", overwrite=True,
                                log=lambda msg: job.log(f"convert: {msg}"))
    # The exactness check compares like with like: both models on the CPU, in fp32, through transformers'
    # SDPA (on a CUDA machine our model would otherwise default to the fused kernel), as the converter's own
    # check does. They train on the job's device afterwards with these same weights.
    source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32, attn_implementation=VERIFY_ATTENTION).eval()
    converted = GatedAttentionForCausalLM.from_pretrained(
        converted_dir, dtype=torch.float32, attn_implementation=VERIFY_ATTENTION).eval()
    with torch.no_grad():
        a, b = source(input_ids=d.valid).logits, converted(input_ids=d.valid).logits
    exact = torch.equal(a, b)
    job.log(f"convert: validation logits of source and converted model {'are bit-identical' if exact else 'DIFFER'} "
            f"(max |diff| {(a - b).abs().max().item():g}; converter's own check {result.max_abs_diff:g})")
    if not exact:
        raise RuntimeError("exact conversion changed the logits")
    runs = {"Llama source (pretrained)": {"model": copy.deepcopy(source), "history": [], "steps": s.pretrain_steps}}
    gate_before = gate_parameters_snapshot(converted)
    for name, model in (("Llama source + continued", source), ("converted + continued", converted)):
        history = _train(model, d.train, s, s.steps, s.continue_lr, s.seed + 1, name, job)
        runs[name] = {"model": model, "history": history, "steps": s.pretrain_steps + s.steps}
    moved = max((p.detach() - gate_before[n].to(p.device)).abs().max().item()
                for n, p in converted.named_parameters() if n in gate_before)
    return Conversion(runs, moved)


# ---------------------------------------------------------------------------------------------
# Measurement


def long_context_perplexities(model, s: Settings, d: Data) -> tuple[float, float]:
    """Perplexity at `long_factor * seq_len`: with the trained RoPE, and with YaRN over the training length."""
    from ..convert.rope import RopeChange, apply_rope_change

    plain = math.exp(evaluate_loss(model, d.valid_long, s.batch_size))
    change = RopeChange(yarn_factor=float(s.long_factor), original_max_position_embeddings=s.seq_len)
    params, max_pos = apply_rope_change(model.config.rope_parameters, model.config.max_position_embeddings, change)
    yarn = math.exp(evaluate_loss(with_rope(model, params, max_pos), d.valid_long, s.batch_size))
    return plain, yarn


@torch.no_grad()
def analysis_metrics(model, rows: torch.Tensor) -> dict:
    """F-Attn, M-Act and gate statistics (the analysis toolkit's definitions) on validation `rows` `[N, T]`."""
    from ..analysis import metrics
    from ..analysis.capture import Capture

    model.eval()
    device = next(model.parameters()).device
    first_attention, max_act, gate_scores = [], [], []
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        for x in rows:
            cap.clear()
            model(input_ids=x[None].to(device), use_cache=False)
            record = cap.records[-1]
            maps = [record.attentions[f][0].float().cpu().numpy() for f in cap.layout.attention_layers]  # [H, T, T] each
            first_attention.append(metrics.first_token_attention(maps).mean(axis=1))  # [n_layers]
            residual = record.residual_stack()[:, 0].float().cpu().numpy()  # [L+1, T, D]
            max_act.append(metrics.m_act_per_layer(residual))  # [L+1]
            gate_scores += [g.float().cpu().numpy().ravel() for g in record.gates.values()]
    first_attention, max_act = np.mean(first_attention, axis=0), np.mean(max_act, axis=0)
    gates = metrics.gate_statistics(np.concatenate(gate_scores) if gate_scores else np.zeros(0))
    return {
        "f_attn": float(first_attention.mean()),
        "m_act": float(max_act[1:].mean()),  # M-Act: decoder layers 1..L, the embeddings excluded
        "gate_mean": gates["mean"],
        "gate_frac_below_0.1": gates["frac_below_0.1"],
        "layers_first_token_attention": first_attention.tolist(),  # one per attention layer
        "layers_max_activation": max_act[1:].tolist(),  # one per decoder layer
    }


def measure(runs: dict[str, dict], s: Settings, d: Data, job: Job) -> tuple[list[dict], list[dict], list[dict]]:
    """Every model on the validation split: the table's row, per-layer rows, and its training history."""
    results, layer_rows, training_rows = [], [], []
    for name, r in runs.items():
        job.log(f"evaluating: {name}")
        model = r["model"].to(job.placement.device).eval()
        row = {"model": name, "steps": r["steps"], "val_ppl": math.exp(evaluate_loss(model, d.valid, s.batch_size))}
        row["ppl_long"], row["ppl_long_yarn"] = long_context_perplexities(model, s, d)
        sink_metrics = analysis_metrics(model, d.valid[: s.analysis_sequences])
        row.update({k: v for k, v in sink_metrics.items() if not k.startswith("layers_")})
        results.append(row)
        per_layer = zip(sink_metrics["layers_first_token_attention"], sink_metrics["layers_max_activation"])
        for l, (fa, ma) in enumerate(per_layer, 1):
            layer_rows.append({"model": name, "layer": l, "first_token_attention": fa, "max_activation": ma})
        first = r["steps"] - len(r["history"])  # steps the model had before this run: the source's, if continued
        training_rows += [{"model": name, **h, "step": first + h["step"]} for h in r["history"]]
    return results, layer_rows, training_rows


# ---------------------------------------------------------------------------------------------
# Report


RESULT_COLUMNS = [
    *columns_of("model", "steps", "val_ppl"),
    ("ppl_long", "ppl@{L}", "{:.2f}"),
    ("ppl_long_yarn", "ppl@{L} YaRN", "{:.2f}"),
    *columns_of("f_attn", "m_act", "gate_mean", GATE_FRACTION),
]
TRAINING_COLUMNS = ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"]


def format_table(rows: list[dict], long_len: int) -> str:
    return format_columns(rows, [(key, title.format(L=long_len), fmt) for key, title, fmt in RESULT_COLUMNS])


def report(results: list[dict], layer_rows: list[dict], training_rows: list[dict], conversion: Conversion,
           s: Settings, job: Job) -> None:
    """Write the CSVs, draw the plots from them, print the table and the converted gates' movement."""
    out = job.folder
    write_csv(out / "results.csv", results, [k for k, _, _ in RESULT_COLUMNS])
    write_csv(out / "training.csv", training_rows, TRAINING_COLUMNS)
    write_csv(out / "layers.csv", layer_rows, ["model", "layer", "first_token_attention", "max_activation"])
    plots = draw_quickstart(out)

    last_gate_score = conversion.runs["converted + continued"]["history"][-1]["gate_score"]
    job.log("")
    job.log(format_table(results, s.long_factor * s.seq_len))
    job.log("")
    job.log(f"converted gates: mean score 0.500 at conversion (exact init) -> {results[-1]['gate_mean']:.3f} after "
            f"{s.steps} steps at gate lr {s.gate_lr:g} (other parameters {s.continue_lr:g}); largest change of a gate "
            f"parameter {conversion.gate_moved:.3g}; training-batch gate score at the last step {last_gate_score:.3f}")
    job.log(f"wrote {job.out / 'results.csv'}, training.csv, layers.csv, {', '.join(p.name for p in plots)} "
            f"({job.minutes():.1f} min)")
