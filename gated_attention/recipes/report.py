"""Tables, CSV files and plots of the recipes.

Every plot is drawn from the CSV files the recipe wrote (`draw_quickstart`,
`draw_sinks`), so it can be redrawn from the files alone.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# Tables and CSV files


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


def draw_quickstart(out: Path) -> list[Path]:
    """quickstart's `loss.png`, `gate_score.png` (from `training.csv`), `first_token_attention.png` and
    `max_activation.png` (from `layers.csv`)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    training, layers = read_csv(out / "training.csv"), read_csv(out / "layers.csv")
    runs = list(dict.fromkeys(r["model"] for r in training))
    models = list(dict.fromkeys(r["model"] for r in layers))
    written = []

    def style(model):  # solid: from scratch; dashed: the conversion experiment
        return {"ls": "-" if model.startswith("scratch") else "--"}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in runs:
        steps, loss = series(training, model, "step", "loss")
        w = max(1, len(loss) // 30)
        ax.plot(steps[w - 1 :], _smooth(loss, w), label=model, **style(model))
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
