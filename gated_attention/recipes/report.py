"""Tables, CSV files and plots of the recipes.

Every plot is drawn from the CSV files the recipe wrote (`draw_quickstart`,
`draw_sinks`), so it can be redrawn from the files alone.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from ..analysis.metrics import GATE_THRESHOLDS

# ---------------------------------------------------------------------------------------------
# Tables and CSV files


# The columns the recipes' tables share, key -> (title, format); a table lists them (`columns_of`) beside its own
# (key, title, format) columns. The gate column is the fraction of gate scores below the first of the analysis'
# thresholds (`analysis.metrics.GATE_THRESHOLDS`).
GATE_FRACTION = f"gate_frac_below_{GATE_THRESHOLDS[0]:g}"
SHARED_COLUMNS = {
    "model": ("model", "{}"), "steps": ("steps", "{}"), "layer": ("layer", "{}"), "val_ppl": ("val ppl", "{:.2f}"),
    "f_attn": ("F-Attn", "{:.3f}"), "m_act": ("M-Act", "{:.1f}"), "gate_mean": ("gate", "{:.3f}"),
    GATE_FRACTION: (f"gate<{GATE_THRESHOLDS[0]:g}", "{:.3f}"),
}


def columns_of(*keys: str) -> list[tuple[str, str, str]]:
    """The (key, title, format) of shared columns (`SHARED_COLUMNS`)."""
    return [(key, *SHARED_COLUMNS[key]) for key in keys]



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


def write_csv(path: Path, rows: list[dict], columns: list[str], comment: str | None = None) -> None:
    """`rows` under a header of `columns`; `comment`, if given, first, as a line starting with "# "."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        if comment:
            f.write(f"# {comment}\n")
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """The rows of a CSV file `write_csv` wrote (its comment line skipped)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("# ")))


# ---------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Tight layout, 120 dpi, figure closed (every plot of the recipes); returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def series(rows: list[dict], model: str, x: str, y: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of `model`'s rows, skipping empty and NaN values of y."""
    pts = [(float(r[x]), float(r[y])) for r in rows if r["model"] == model and r[y] not in ("", "nan")]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(values: list[float], window: int) -> list[float]:
    if len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid").tolist()


def uniform_first_token_attention(seq_len: int) -> float:
    """F-Attn of uniform causal attention: query q (q >= 1) puts 1/(q+1) on token 0."""
    return float(np.mean([1.0 / (q + 1) for q in range(1, seq_len)]))


def read_settings(out: Path) -> dict:
    """The run's `settings.json` (what `common.Job.start` wrote)."""
    return json.loads((out / "settings.json").read_text(encoding="utf-8"))


class Styles:
    """Line styles that keep coincident curves visible: every model its own colour and marker, and each
    curve drawn narrower (line and marker) than the one before, so one that lies exactly on an earlier
    curve shows as a thin line inside a wide one, in two colours. A curve whose points equal an earlier
    model's exactly also says so in the legend."""

    MARKERS = ("o", "s", "^", "D", "v", "P")

    def __init__(self, models: list[str]):
        self.models = models
        self.drawn: list[tuple[str, list[float], list[float]]] = []

    def plot(self, ax, model: str, x: list[float], y: list[float], *, markers: int = 0) -> None:
        """Draw `model`'s points; `markers`: about that many markers along a long curve (0: on every point)."""
        i = self.models.index(model)
        same = next((name for name, dx, dy in self.drawn if (dx, dy) == (x, y)), None)
        self.drawn.append((model, x, y))
        style = dict(color=f"C{i}", lw=max(0.8, 3.2 - 0.6 * i), marker=self.MARKERS[i % len(self.MARKERS)],
                     ms=max(3.0, 9.0 - 1.5 * i), ls="-" if model.startswith("scratch") else "--")
        if markers:
            style["markevery"] = (i * max(1, len(x) // markers) // len(self.models), max(1, len(x) // markers))
        label = model if same is None else f"{model} (= {same})"
        ax.plot(x, y, label=label, **style)


def _legend(ax) -> None:
    ax.legend(fontsize=8, title="drawn wide to narrow: coinciding curves nest", title_fontsize=7)


def draw_quickstart(out: Path) -> list[Path]:
    """quickstart's `loss.png`, `gate_score.png` (from `training.csv`), `first_token_attention.png` and
    `max_activation.png` (from `layers.csv`); `settings.json` gives the sequence length and the step at which
    the source was converted.

    Steps are each model's own: the continued runs go on from the source's last step, so they are drawn after
    it. Coincident curves stay visible (`Styles`)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    training, layers = read_csv(out / "training.csv"), read_csv(out / "layers.csv")
    settings = read_settings(out)
    models = list(dict.fromkeys(r["model"] for r in layers))  # every model: one colour each in every plot
    runs = [m for m in models if any(r["model"] == m for r in training)]  # the ones trained in this run
    written = []

    def conversion_line(ax):
        ax.axvline(settings["pretrain_steps"], color="gray", lw=0.8, ls=":",
                   label=f"conversion (after the source's {settings['pretrain_steps']} steps)")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = Styles(models)
    for model in runs:
        steps, loss = series(training, model, "step", "loss")
        w = max(1, len(loss) // 30)
        styles.plot(ax, model, steps[w - 1 :], _smooth(loss, w), markers=10)
    conversion_line(ax)
    ax.set(xlabel="step", ylabel="training loss (nats, moving mean)", title="Training loss")
    _legend(ax)
    written.append(save_figure(fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = Styles(models)
    for model in runs:
        steps, gate = series(training, model, "step", "gate_score")
        if gate:
            styles.plot(ax, model, steps, gate, markers=10)
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    conversion_line(ax)
    ax.set(xlabel="step", ylabel="mean gate score (training batches)", title="Gate score during training")
    _legend(ax)
    written.append(save_figure(fig, out / "gate_score.png"))

    for column, name, ylabel in (
        ("first_token_attention", "first_token_attention.png", "attention on the first token (mean over heads, queries)"),
        ("max_activation", "max_activation.png", "max |hidden| (layer output)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles = Styles(models)
        for model in models:
            styles.plot(ax, model, *series(layers, model, "layer", column))
        if column == "first_token_attention":
            uniform = uniform_first_token_attention(settings["seq_len"])
            ax.axhline(uniform, color="black", lw=1, ls=":",
                       label=f"uniform causal attention over {settings['seq_len']} tokens ({uniform:.3f})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="layer (1-based)", ylabel=ylabel, title=ylabel.split(" (")[0].capitalize() + " per layer")
        _legend(ax)
        written.append(save_figure(fig, out / name))
    return written


def draw_sinks(out: Path, sink_threshold: float) -> list[Path]:
    """The sinks preset's `first_token_attention.png`, `max_activation.png` (from `layers.csv`) and
    `sink_trend.png` (from `probes.csv`)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    layers, probes = read_csv(out / "layers.csv"), read_csv(out / "probes.csv")
    models = list(dict.fromkeys(r["model"] for r in layers))
    colors = dict(zip(models, ("C0", "C1", "C2", "C3")))

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in models:
        ax.plot(*series(layers, model, "layer", "f_attn"), marker="o", color=colors[model], label=model)
    ax.axhline(sink_threshold, color="gray", lw=0.8, ls=":", label=f"sink threshold {sink_threshold:g}")
    seq_len = read_settings(out)["seq_len"]
    uniform = uniform_first_token_attention(seq_len)
    ax.axhline(uniform, color="black", lw=1, ls=":", label=f"uniform causal attention over {seq_len} tokens ({uniform:.3f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="layer (1-based)", ylabel="attention on the first token (mean over heads, queries)",
           title="First-token attention per layer", ylim=(0, None))
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "first_token_attention.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in models:
        ax.plot(*series(layers, model, "layer", "first_token_max"), marker="o", color=colors[model],
                label=f"{model}: first token")
        ax.plot(*series(layers, model, "layer", "other_tokens_max"), marker="x", ls="--", color=colors[model],
                label=f"{model}: max over other tokens")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="layer (1-based)", ylabel="max |hidden| of the layer output", title="Massive activations per layer")
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "max_activation.png"))

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        layer_ids = sorted({int(r["layer"]) for r in probes if r["model"] == model})
        for l in layer_ids:
            rows = [r for r in probes if r["model"] == model and int(r["layer"]) == l]
            ax.plot(*series(rows, model, "step", "f_attn"), marker=".", label=f"layer {l}")
        ax.axhline(sink_threshold, color="gray", lw=0.8, ls=":")
        ax.set(xlabel="training step", ylabel="first-token attention (probe sequences)", title=model)
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "sink_trend.png"))
    return written


def draw_trained(out: Path, sink_threshold: float) -> list[Path]:
    """The trained preset's `trained_layers.png` (per-layer F-Attn and M-Act of the source, and of control and
    gated after training, from `layers.csv`) and `trained_trend.png` (both against the step, from `probes.csv`:
    F-Attn over the source's sink layers, M-Act over all layers)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    layers, probes = read_csv(out / "layers.csv"), read_csv(out / "probes.csv")
    style = {"source": dict(color="black", ls="--", marker=""), "control": dict(color="C0", marker="o"),
             "gated": dict(color="C1", marker="s")}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, kw in style.items():
        left.plot(*series(layers, model, "layer", "f_attn"), label=model, ms=3, **kw)
        right.plot(*series(layers, model, "layer", "m_act"), label=model, ms=3, **kw)
    left.axhline(sink_threshold, color="gray", lw=0.8, ls=":", label=f"sink threshold {sink_threshold:g}")
    left.set(xlabel="layer (1-based)", ylabel="attention on the first token", title="F-Attn per layer", ylim=(0, 1))
    right.set(xlabel="layer (1-based)", ylabel="max |hidden| of the layer output", title="M-Act per layer", yscale="log")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    written = [save_figure(fig, out / "trained_layers.png")]

    source = [r for r in layers if r["model"] == "source"]
    sink_layers = {r["layer"] for r in source if float(r["f_attn"]) >= sink_threshold} or {r["layer"] for r in source}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for model in ("control", "gated"):
        rows = [r for r in probes if r["model"] == model]
        steps = sorted({int(r["step"]) for r in rows})
        f_attn = [np.mean([float(r["f_attn"]) for r in rows if int(r["step"]) == s and r["layer"] in sink_layers]) for s in steps]
        m_act = [np.mean([float(r["m_act"]) for r in rows if int(r["step"]) == s]) for s in steps]
        left.plot(steps, f_attn, marker="o", color=style[model]["color"], label=model)
        right.plot(steps, m_act, marker="o", color=style[model]["color"], label=model)
    before_f = np.mean([float(r["f_attn"]) for r in source if r["layer"] in sink_layers])
    before_m = np.mean([float(r["m_act"]) for r in source])
    left.axhline(before_f, color="black", ls="--", lw=1, label="source")
    right.axhline(before_m, color="black", ls="--", lw=1, label="source")
    left.set(xlabel="training step", ylabel="F-Attn, mean over the source's sink layers", title="Sink against steps")
    right.set(xlabel="training step", ylabel="M-Act, mean over layers", title="Massive activations against steps")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "trained_trend.png"))
    return written


def draw_recovery(out: Path) -> Path:
    """The trained preset's `trained_recovery.png` with `--remove-sink`: each model's held-out loss against the
    step (`probes.csv`, from step 0, right after the removal), beside the source's with its sink and the loss
    right after the removal (`results.csv`)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    probes, results = read_csv(out / "probes.csv"), read_csv(out / "results.csv")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, color, marker in (("control", "C0", "o"), ("gated", "C1", "s")):
        points = sorted({(int(r["step"]), float(r["heldout_loss"])) for r in probes if r["model"] == model})
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=color, label=f"{model}, sink removed")
    first = results[0]
    ax.axhline(float(first["heldout_loss_before"]), color="black", ls="--", lw=1, label="source, with its sink")
    ax.axhline(float(first["heldout_loss_removed"]), color="gray", ls=":", lw=1, label="right after the removal")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="training step", ylabel="held-out loss (nats)",
           title=f"Recovery without the sink\n(first-token attention masked in layers {first['removed_layers']})")
    ax.legend(fontsize=8)
    return save_figure(fig, out / "trained_recovery.png")


def draw_backcopy(out: Path, sink_threshold: float, n_tokens: int) -> list[Path]:
    """The backcopy preset's `attention_maps.png` (both models' maps on one held-out sequence, from
    `attention_maps.npz`: every head of the control's sink layer, the trigger queries marked) and `sink_trend.png`
    (F-Attn at dormant and at active queries against the step, sink layer, from `probes.csv`; the sink layer is
    `results.csv`'s)."""
    plt = _pyplot()

    results = read_csv(out / "results.csv")
    layer = int(results[0]["sink_layer"])
    maps = np.load(out / "attention_maps.npz")
    tokens = maps["tokens"]
    triggers = np.flatnonzero(tokens > n_tokens)  # the active queries
    models = [r["model"] for r in results]
    heads = maps[f"{models[0]}_layer{layer}"].shape[0]
    fig, axes = plt.subplots(heads, len(models), figsize=(5.5 * len(models), 5 * heads), squeeze=False)
    for j, model in enumerate(models):
        a = maps[f"{model}_layer{layer}"]  # [H, T, T]
        for h in range(heads):
            ax = axes[h][j]
            im = ax.imshow(a[h], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.scatter(np.full(len(triggers), -1.5), triggers, marker=">", s=10, color="red", clip_on=False,
                       label="trigger query (active)")
            ax.set(xlabel="key position", ylabel="query position",
                   title=f"{model}, layer {layer}, head {h + 1}: F-Attn dormant {float(results[j]['f_attn_dormant']):.2f}")
            if h == 0 and j == 0:
                ax.legend(fontsize=7, loc="lower left")
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    path = out / "attention_maps.png"
    fig.savefig(path, dpi=120)  # no tight_layout: it fights the shared colour bar
    _pyplot().close(fig)
    written = [path]

    probes = [r for r in read_csv(out / "probes.csv") if int(r["layer"]) == layer]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, model in enumerate(models):
        ax.plot(*series(probes, model, "step", "f_attn_dormant"), marker="o", ms=3, color=f"C{i}",
                label=f"{model}: dormant queries")
        ax.plot(*series(probes, model, "step", "f_attn_active"), marker="x", ms=3, ls="--", color=f"C{i}",
                label=f"{model}: active (trigger) queries")
    ax.axhline(sink_threshold, color="gray", lw=0.8, ls=":", label=f"sink threshold {sink_threshold:g}")
    ax.set(xlabel="training step", ylabel="attention on the first token (probe sequences)", ylim=(0, 1),
           title=f"First-token attention against steps, layer {layer}")
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "sink_trend.png"))
    return written


def stability_goal_lines(v) -> list[str]:
    """The stability preset's verdict (`stability.Verdict`) in words: the sensitivities, then the goal's two parts."""
    sens = v.sensitivity
    lines = ["learning-rate sensitivity: " + ", ".join(f"{m} {x:.4f}" for m, x in sens.items())]
    if "gated" not in sens:
        return lines
    if v.ratio is not None:
        lines.append(f"the goal, gated against control: sensitivity at most half ({sens['gated']:.4f} vs "
                     f"{sens['control']:.4f}, {v.ratio:.2f}x: {'met' if v.halved else 'not met'})")
    elif math.isnan(sens["control"]):
        lines.append("the goal: no rate trains the control (every run diverged or ended no lower than it began), so it "
                     "has no sensitivity to halve; sweep lower rates (not met)")
    else:
        lines.append("the goal: the control's sensitivity is 0, nothing to halve (not met)")
    for f in v.failures:
        reading = "its sweep's best final loss" if f.reading == "sweep" else "the run's own lowest held-out loss"
        if f.lr is None:
            lines.append(f"the control neither diverged nor ended 0.5 above {reading} at any rate: the sweep does not "
                         "reach its failure (not met)")
            continue
        c, g, whose = f.control, f.gated, f"{f.reading}'s"
        lines.append(f"highest rate where the control fails against {reading}: {f.lr:g} (control "
                     f"{'diverged, ' if c['diverged'] else ''}ended at {c['final_loss']:.4f}, {whose} best "
                     f"{f.control_best:.4f}); gated there ends at {g['final_loss']:.4f}, {f.gated_excess:.4f} above "
                     f"its {whose} best {f.gated_best:.4f} ({'within' if f.held else 'not within'} 0.1: "
                     f"{'met' if f.held else 'not met'})")
    return lines


def draw_stability(out: Path) -> list[Path]:
    """The stability preset's `lr_sweep.png` (final held-out loss against the peak rate, one line per arm; a diverged
    run drawn at the arm's loss before training, as the sensitivity counts it, with a cross) and
    `loss_at_highest_lr.png` (every arm's training loss at the highest rate, raw and smoothed, a cross where a
    loss became NaN), from `results.csv`, `sensitivity.csv` and `training.csv`."""
    plt = _pyplot()
    results, sensitivity = read_csv(out / "results.csv"), read_csv(out / "sensitivity.csv")
    smoothing = float(read_settings(out)["smoothing"])
    models = [r["model"] for r in sensitivity]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(sensitivity):
        rows = [x for x in results if x["model"] == r["model"]]
        initial = float(r["initial_loss"])
        lrs = [float(x["lr"]) for x in rows]
        capped = [min(float(x["final_loss"]), initial) if math.isfinite(float(x["final_loss"])) else initial for x in rows]
        ax.plot(lrs, capped, marker="o", color=f"C{i}", lw=max(0.8, 2.6 - 0.6 * i),
                label=f"{r['model']} (sensitivity {float(r['lr_sensitivity']):.3f})")
        failed = [(lr, y) for lr, y, x in zip(lrs, capped, rows) if x["diverged"] == "True"]
        if failed:
            ax.plot(*zip(*failed), ls="none", marker="x", ms=11, mew=2, color=f"C{i}")
    ax.axhline(float(sensitivity[0]["initial_loss"]), color="gray", lw=0.8, ls=":",
               label="loss before training (x: diverged, drawn here)")
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final held-out loss (nats per token)",
           title="Final loss against the learning rate")
    ax.legend(fontsize=8)
    written = [save_figure(fig, out / "lr_sweep.png")]

    training = read_csv(out / "training.csv")
    top = max(float(r["lr"]) for r in results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, model in enumerate(models):
        rows = [r for r in training if r["model"] == model and float(r["lr"]) == top]
        steps, losses = [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]
        ema, smooth = None, []
        for loss in losses:
            ema = loss if ema is None else smoothing * ema + (1 - smoothing) * loss
            smooth.append(ema)
        ax.plot(steps, losses, color=f"C{i}", lw=0.6, alpha=0.35)
        ax.plot(steps, smooth, color=f"C{i}", lw=1.8, label=f"{model} (smoothed, EMA {smoothing:g})")
        last = next((r for r in results if r["model"] == model and float(r["lr"]) == top), None)
        if last is not None and last["diverged"] == "True" and steps:
            ax.plot(steps[-1], losses[-1], marker="x", ms=11, mew=2, color=f"C{i}")
    ax.set(xlabel="training step", ylabel="training loss", title=f"Training loss at the highest rate, {top:g} "
           "(x: diverged)")
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "loss_at_highest_lr.png"))
    return written
