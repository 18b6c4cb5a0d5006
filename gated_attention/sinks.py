"""`gated-attention quickstart --preset sinks`: does an attention sink form, and does the G1 gate remove it?

Seed 000 (Table 4) reports that the sigmoid output gate removes the attention
sink (first-token attention 0.467 -> 0.048) and the massive activations. This
job trains the pair that claim is about on the package corpus
(`data.documents("packages", ...)`): an ungated `GatedAttentionForCausalLM`
and the same model with the G1 gate, from the same initial weights
(`quickstart.scratch_models`) on the same batches (the step order is a pure
function of the seed), and reports per layer, for both models:

- F-Attn: mean attention on the first token over heads and validation queries q >= 1;
- M-Act: max |hidden| of the layer's output, mean over validation sequences;
- the first token's max |hidden| against the max over every other token;
- gate mean and fraction of gate scores below 0.1;
- validation perplexity.

Every `probe_every` steps both models' per-layer F-Attn and M-Act are probed
on a few validation sequences, which shows the trend with training. A sink
"forms" (issue 14) when the ungated model's most sink-like layer reaches
F-Attn >= 0.3; the table prints the uniform-attention value beside it.

Output, in `--out`: `layers.csv` (the printed table), `summary.csv` (one row per
model), `probes.csv`, `training.csv`, `corpus.json` (corpus fingerprint, size,
package versions) and PNGs drawn from those CSVs (`sinks_plots.draw`).

Index conventions: layers are 1-based (layer l's output is `X[l]`); the first
token is position 0, the BOS token every packed row starts with.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import data
from .training import TrainConfig, evaluate_loss, make_optimizer, make_scheduler, train

SINK_THRESHOLD = 0.3  # issue 14: F-Attn of the most sink-like layer that counts as a sink
ARCHITECTURES = ("dense", "hybrid")


@dataclass
class SinkSettings:
    """Everything that decides the numbers of the sinks preset."""

    corpus: str = "packages"
    corpus_chars: int | None = None  # cap on the corpus (None: data.PACKAGE_CORPUS_CHARS, or all of "embedded")
    tokenizer_chars: int | None = None  # embedded-corpus prefix the BPE is trained on (None: all of it)
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    seq_len: int = 128
    batch_size: int = 32
    steps: int = 1000
    lr: float = 1e-2
    gate_lr: float = 1e-2
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    eval_sequences: int = 64  # validation sequences for perplexity
    analysis_sequences: int = 16  # validation sequences for the per-layer metrics
    probe_every: int = 200  # steps between probes of F-Attn / M-Act (0: only at the end)
    probe_sequences: int = 4
    seed: int = 0
    ungated_only: bool = False  # the sink search decides by the ungated model alone (benchmarks/sink_search.py)
    architecture: str = "dense"  # "hybrid": Gated DeltaNet hybrid 3:1, ungated vs G1 full-attention layers
    hybrid_ratio: int = 3
    analyze: bool | None = None  # run `gated-attention analyze` on both trained models (None: for the hybrid)


SINKS_SMOKE = dict(
    corpus_chars=300_000, tokenizer_chars=150_000, vocab_size=300, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, seq_len=32, batch_size=4, steps=4, eval_sequences=4,
    analysis_sequences=2, probe_every=2, probe_sequences=2,
)

# quickstart flags that also set the sinks preset (dest names match SinkSettings fields)
_FLAGS = ("steps", "batch_size", "seq_len", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
          "lr", "gate_lr", "eval_sequences", "seed", "corpus", "corpus_chars", "probe_every", "weight_decay", "ungated_only", "analysis_sequences",
          "architecture", "analyze")


def settings_from_args(args: argparse.Namespace) -> SinkSettings:
    from .cli import CLIError

    s = SinkSettings(**(SINKS_SMOKE if getattr(args, "smoke", False) else {}))
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            setattr(s, name, value)
    if getattr(args, "hidden_size", None) is not None:
        s.intermediate_size = 3 * s.hidden_size
    if getattr(args, "gate_lr", None) is None:
        s.gate_lr = s.lr  # from scratch the gates train with everything else
    if s.architecture not in ARCHITECTURES:
        raise CLIError(f"--architecture must be one of {ARCHITECTURES}, got {s.architecture!r}")
    if s.architecture == "hybrid" and getattr(args, "smoke", False) and getattr(args, "num_hidden_layers", None) is None:
        s.num_hidden_layers = s.hybrid_ratio  # one block: GDN, GDN, full attention
    if s.architecture == "hybrid" and s.num_hidden_layers < s.hybrid_ratio:
        raise CLIError(f"a {s.hybrid_ratio}:1 hybrid needs --layers >= {s.hybrid_ratio} (one full-attention layer "
                       f"closes every {s.hybrid_ratio} layers)")
    if s.hidden_size % s.num_attention_heads:
        raise CLIError(f"--hidden-size {s.hidden_size} is not a multiple of --heads {s.num_attention_heads}")
    if min(s.steps, s.batch_size, s.eval_sequences) < 1 or s.seq_len < 8:
        raise CLIError("--steps, --batch-size, --eval-sequences must be >= 1 and --seq-len >= 8")
    return s


def uniform_first_token_attention(seq_len: int) -> float:
    """F-Attn of uniform causal attention: query q (q >= 1) puts 1/(q+1) on token 0."""
    return float(np.mean([1.0 / (q + 1) for q in range(1, seq_len)]))


# ---------------------------------------------------------------------------------------------
# Models


def model_pair(s: SinkSettings, tokenizer):
    """Ungated and G1-gated models with identical weights apart from the gates.

    Dense: `quickstart.scratch_models`. Hybrid: `GatedDeltaNetHybridForCausalLM`
    at seed 002's `hybrid_ratio`:1 (every third layer full attention), the GDN
    layers as wide as the attention (`num_attention_heads` heads of
    `head_dim` keys and `2 * head_dim` values); only the full-attention layers differ.
    """
    from .quickstart import _shape, scratch_models

    if s.architecture == "dense":
        return scratch_models(s, tokenizer)
    from .configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig
    from .modeling.gated_deltanet_hybrid import GatedDeltaNetHybridForCausalLM

    head_dim = s.hidden_size // s.num_attention_heads
    shape = dict(_shape(s, tokenizer), hybrid_ratio=s.hybrid_ratio, linear_num_key_heads=s.num_attention_heads,
                 linear_key_head_dim=head_dim, linear_value_head_dim=2 * head_dim)
    torch.manual_seed(s.seed)
    ungated = GatedDeltaNetHybridForCausalLM(GatedDeltaNetHybridConfig(**shape, attn_gate=None))
    torch.manual_seed(s.seed)
    gated = GatedDeltaNetHybridForCausalLM(GatedDeltaNetHybridConfig(**shape, attn_gate={"position": "G1"}))
    missing, unexpected = gated.load_state_dict(ungated.state_dict(), strict=False)
    assert not unexpected and all("attn_gate" in k for k in missing), (missing, unexpected)
    return ungated, gated


ANALYZE_METRICS = ("f_attn", "m_act", "gate_mean", "sink_spike_alignment", "peak_excess", "inter_spike_retention")


def analyze_saved(model, tokenizer, name: str, out: Path, max_length: int) -> list[dict]:
    """Save `model` to `out/models/<name>` and run what `gated-attention analyze` runs on it.

    Equivalent command: `gated-attention analyze OUT/models/<name> --out OUT/analyze/<name>
    --max-length <seq_len>` (built-in prose/code/math samples, 1000 bootstrap resamples).
    """
    from .analysis import cli as analyze_cli

    folder = out / "models" / name
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = argparse.Namespace(model=str(folder), out=str(out / "analyze" / name), text_file=None, n_per_domain=4,
                              max_length=max_length, tokenizer=None, device="cpu", dtype="float32",
                              trust_remote_code=False, intervene=None, k=1, bootstrap=1000, seed=0)
    args.device = str(next(model.parameters()).device)
    analyze_cli.run(args)
    from .quickstart import read_csv

    return [{"model": name, **r} for r in read_csv(out / "analyze" / name / "metrics.csv")]


# ---------------------------------------------------------------------------------------------
# Per-layer metrics


@torch.no_grad()
def layer_metrics(model, rows: torch.Tensor) -> list[dict]:
    """Per decoder layer (1-based): F-Attn, M-Act, first-token and other-token max |hidden|, gate statistics.

    rows: validation sequences `[N, T]`, each starting with BOS. Each value is the
    mean over the N sequences (gate statistics: over all their scores).
    """
    from .analysis import metrics as M
    from .analysis.capture import Capture

    model.eval()
    device = next(model.parameters()).device
    fa, m_act, first, other, gates = [], [], [], [], {}
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        full = cap.layout.full_attention_layers
        for x in rows:
            cap.clear()
            model(input_ids=x[None].to(device), use_cache=False)
            record = cap.records[-1]
            maps = [record.attentions[f][0].float().cpu().numpy() for f in full]  # [H, T, T] each
            fa.append(M.first_token_attention(maps).mean(axis=1))  # [n_attention_layers]
            token_max = M.token_max_abs(record.residual_stack()[:, 0].float().cpu().numpy())[1:]  # [L, T]: X[1..L]
            m_act.append(token_max.max(axis=1))
            first.append(token_max[:, 0])
            other.append(token_max[:, 1:].max(axis=1))
            for f, g in record.gates.items():
                gates.setdefault(f, []).append(g.float().cpu().numpy().ravel())
    fa_by_layer = dict(zip(full, np.mean(fa, axis=0)))
    out = []
    for l, (ma, fm, om) in enumerate(zip(np.mean(m_act, axis=0), np.mean(first, axis=0), np.mean(other, axis=0)), 1):
        g = M.gate_statistics(np.concatenate(gates[l]) if l in gates else np.zeros(0))
        out.append({
            "layer": l, "f_attn": float(fa_by_layer.get(l, math.nan)), "m_act": float(ma),
            "first_token_max": float(fm), "other_tokens_max": float(om),
            "gate_mean": g["mean"], "gate_frac_below_0.1": g["frac_below_0.1"],
        })
    return out


# ---------------------------------------------------------------------------------------------
# Training with probes


def train_with_probes(model, name: str, s: SinkSettings, train_rows, probe_rows, progress: bool, log) -> tuple[list, list]:
    """Train for `s.steps`, probing per-layer F-Attn and M-Act every `s.probe_every` steps.

    Training runs in chunks between probes with one optimizer and scheduler;
    the batch of step k depends only on (seed, k), so chunking changes nothing.
    """
    config = TrainConfig(steps=s.steps, batch_size=s.batch_size, lr=s.lr, gate_lr=s.gate_lr, seed=s.seed,
                         warmup_steps=max(1, int(s.warmup_fraction * s.steps)), weight_decay=s.weight_decay)
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps)
    every = s.probe_every if s.probe_every > 0 else s.steps
    history, probes, t0 = [], [], time.perf_counter()
    for start in range(0, s.steps, every):
        stop = min(s.steps, start + every)
        chunk = TrainConfig(**{**asdict(config), "steps": stop})
        history += train(model, train_rows, chunk, optimizer, scheduler, start_step=start, desc=name, progress=progress)
        layers = layer_metrics(model, probe_rows)
        minutes = (time.perf_counter() - t0) / 60
        probes += [{"model": name, "step": stop, "minutes": minutes, "loss": history[-1]["loss"], **r} for r in layers]
        log(f"{name}: step {stop}  {minutes:5.1f} min  loss {history[-1]['loss']:.3f}  F-Attn "
            + " ".join(f"{r['f_attn']:.3f}" for r in layers) + "  M-Act " + " ".join(f"{r['m_act']:.1f}" for r in layers))
    return history, probes


# ---------------------------------------------------------------------------------------------
# Table


TABLE_COLUMNS = [
    ("model", "model", "{}"),
    ("layer", "layer", "{}"),
    ("f_attn", "F-Attn", "{:.3f}"),
    ("m_act", "M-Act", "{:.1f}"),
    ("first_token_max", "max|x| tok 0", "{:.1f}"),
    ("other_tokens_max", "max|x| others", "{:.1f}"),
    ("gate_mean", "gate", "{:.3f}"),
    ("gate_frac_below_0.1", "gate<0.1", "{:.3f}"),
    ("val_ppl", "val ppl", "{:.2f}"),
]


def format_table(rows: list[dict]) -> str:
    from .quickstart import format_columns

    return format_columns(rows, TABLE_COLUMNS)


# ---------------------------------------------------------------------------------------------
# The job


def run(args: argparse.Namespace) -> int:
    from .quickstart import write_csv
    from .sinks_plots import draw

    s = settings_from_args(args)
    progress = not getattr(args, "no_progress", False)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    cache = Path(args.cache).expanduser() if getattr(args, "cache", None) else data.cache_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731  (a background run's log is read while it runs)
    t_start = time.perf_counter()
    (out / "settings.json").write_text(json.dumps(asdict(s), indent=1), encoding="utf-8")

    tokenizer = data.load_tokenizer(s.vocab_size, s.tokenizer_chars, cache)
    streams, info = {}, {"corpus": s.corpus}
    for split in ("train", "validation"):
        docs = data.documents(s.corpus, split, s.corpus_chars)
        streams[split] = data.corpus_tokens(tokenizer, split, s.corpus_chars, corpus=s.corpus)
        info[split] = {"fingerprint": data.corpus_fingerprint(docs), "documents": len(docs),
                       "characters": sum(len(d.text) for d in docs), "tokens": int(len(streams[split]))}
    if s.corpus == "packages":
        info.update(data.package_corpus_manifest())
    (out / "corpus.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    bos = tokenizer.bos_token_id
    train_rows = data.pack(streams["train"], s.seq_len, bos)
    valid = data.pack(streams["validation"], s.seq_len, bos, max_rows=max(s.eval_sequences, s.analysis_sequences))
    seen = s.steps * s.batch_size
    log(f"data: {s.corpus} corpus {info['train']['fingerprint']}/{info['validation']['fingerprint']}: "
        f"{info['train']['tokens']:,} training tokens ({len(train_rows)} rows of {s.seq_len}), "
        f"{info['validation']['tokens']:,} validation tokens; {s.steps} steps x {s.batch_size} rows = "
        f"{seen / max(1, len(train_rows)):.2f} epochs")

    ungated, gated = model_pair(s, tokenizer)
    # `--device` (quickstart's; "auto" or absent: CUDA where there is one). Only the CPU path has been run.
    requested = getattr(args, "device", None) or "auto"
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    ungated, gated = ungated.to(device), gated.to(device)
    log(f"models: {s.architecture}, {s.num_hidden_layers} layers, width {s.hidden_size}, {s.num_attention_heads} heads; "
        f"{sum(p.numel() for p in ungated.parameters()):,} parameters ungated, "
        f"{sum(p.numel() for p in gated.parameters()):,} with the G1 gate (same initial weights otherwise)")

    layer_rows, summary, probes, training_rows = [], [], [], []
    for name, model in (("no gate", ungated), ("G1 gate", gated))[: 1 if s.ungated_only else 2]:
        t0 = time.perf_counter()
        history, model_probes = train_with_probes(model, name, s, train_rows, valid[: s.probe_sequences], progress, log)
        minutes = (time.perf_counter() - t0) / 60
        val_ppl = math.exp(evaluate_loss(model, valid[: s.eval_sequences], s.batch_size))
        layers = layer_metrics(model, valid[: s.analysis_sequences])
        layer_rows += [{"model": name, **r, "val_ppl": val_ppl} for r in layers]
        fa = [r["f_attn"] if not math.isnan(r["f_attn"]) else -1.0 for r in layers]  # GDN layers have no F-Attn
        summary.append({
            "model": name, "steps": s.steps, "train_minutes": minutes, "final_train_loss": history[-1]["loss"],
            "val_ppl": val_ppl, "f_attn_mean": float(np.mean([v for v in fa if v >= 0])),
            "f_attn_max_layer": int(np.argmax(fa)) + 1, "f_attn_max": float(np.max(fa)), "m_act": float(np.mean([r["m_act"] for r in layers])),
            "gate_mean": float(np.nanmean([r["gate_mean"] for r in layers])) if name != "no gate" else math.nan,
        })
        probes += model_probes
        training_rows += [{"model": name, **h} for h in history]

    write_csv(out / "layers.csv", layer_rows, [k for k, _, _ in TABLE_COLUMNS])
    write_csv(out / "summary.csv", summary, list(summary[0]))
    write_csv(out / "probes.csv", probes, ["model", "step", "minutes", "loss", "layer", "f_attn", "m_act",
                                           "first_token_max", "other_tokens_max", "gate_mean", "gate_frac_below_0.1"])
    write_csv(out / "training.csv", training_rows, ["model", "step", "loss", "gate_score", "lr", "gate_lr", "batch", "seconds"])
    plots = draw(out)
    analyzed = []
    if s.analyze if s.analyze is not None else s.architecture == "hybrid":
        models = {"no gate": ungated, "G1 gate": gated}
        for name in [r["model"] for r in summary]:
            analyzed += analyze_saved(models[name], tokenizer, name.replace(" ", "_"), out, s.seq_len)
        write_csv(out / "analyze.csv", analyzed, list(analyzed[0]))

    uniform = uniform_first_token_attention(s.seq_len)
    base = summary[0]
    formed = base["f_attn_max"] >= SINK_THRESHOLD
    log("")
    log(format_table(layer_rows))
    log("")
    log(f"uniform causal attention over {s.seq_len} tokens gives F-Attn {uniform:.3f}. Ungated model: most sink-like "
        f"layer {base['f_attn_max_layer']} at F-Attn {base['f_attn_max']:.3f} -> "
        + (f"a sink formed (>= {SINK_THRESHOLD})" if formed else f"no sink (< {SINK_THRESHOLD})"))
    for r in analyzed:
        if r["metric"] in ANALYZE_METRICS:
            log(f"analyze {r['model']:<8} {r['metric']:<22} {r['anchor']:<15} {float(r['mean']):8.4g} "
                f"[{float(r['ci_low']):.4g}, {float(r['ci_high']):.4g}]  n={r['n']}")
    log(f"wrote {out / 'layers.csv'}, summary.csv, probes.csv, training.csv, corpus.json, "
        f"{', '.join(p.name for p in plots)} ({(time.perf_counter() - t_start) / 60:.1f} min)")
    return 0
