"""Plots of the sinks preset, drawn only from its CSV files (so they can be redrawn from the files alone)."""

from __future__ import annotations

from pathlib import Path


def draw(out: Path) -> list[Path]:
    """`first_token_attention.png`, `max_activation.png` (from `layers.csv`) and `sink_trend.png` (`probes.csv`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from .quickstart import read_csv, save_figure

    layers, probes = read_csv(out / "layers.csv"), read_csv(out / "probes.csv")
    models = list(dict.fromkeys(r["model"] for r in layers))
    colors = dict(zip(models, ("C0", "C1", "C2", "C3")))

    def values(rows, model, x, y):
        pts = [(float(r[x]), float(r[y])) for r in rows if r["model"] == model and r[y] not in ("", "nan")]
        return [p[0] for p in pts], [p[1] for p in pts]

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in models:
        ax.plot(*values(layers, model, "layer", "f_attn"), marker="o", color=colors[model], label=model)
    ax.axhline(0.3, color="gray", lw=0.8, ls=":", label="sink threshold 0.3")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="layer (1-based)", ylabel="attention on the first token (mean over heads, queries)",
           title="First-token attention per layer", ylim=(0, None))
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "first_token_attention.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in models:
        ax.plot(*values(layers, model, "layer", "first_token_max"), marker="o", color=colors[model],
                label=f"{model}: first token")
        ax.plot(*values(layers, model, "layer", "other_tokens_max"), marker="x", ls="--", color=colors[model],
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
            ax.plot(*values(rows, model, "step", "f_attn"), marker=".", label=f"layer {l}")
        ax.axhline(0.3, color="gray", lw=0.8, ls=":")
        ax.set(xlabel="training step", ylabel="first-token attention (probe sequences)", title=model)
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out / "sink_trend.png"))
    return written
