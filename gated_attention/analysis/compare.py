"""Several models side by side, as the hybrid paper compares Base with Instruct and one size with the next.

`analyze A B C --out DIR` writes each model's analysis to `DIR/<name>/`, then this module reads their
`arrays.npz` (never live tensors) and writes, in DIR:

- `comparison.csv`: one row per model and residual position l = 0..L: the layer's type, whether it is a
  softmax-attention layer, and the mean over inputs of the consensus sink's max |X[l]| (`m_sink`), of
  the first token's (`m_first`) and of the largest over all tokens (`m_act`);
- `comparison.png`: one panel per model, the consensus sink's max activation layer by layer, the
  attention layers marked (the first token's for a model without softmax attention, dashed);
- `summary.md`: the models, their folders and each one's headline numbers;
- `quantization.csv`, where the models were measured under `--quantization`: every model's rows of its own
  `quantization.csv` (one per scheme and arm) after a `model` and a `folder` column.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display is ever needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# What `write_comparison` writes beside the model folders: no model folder may take one of these names.
FILES = ("comparison.csv", "comparison.png", "summary.md", "quantization.csv")
COLUMNS = ["model", "folder", "layer", "layer_type", "is_attention", "m_sink", "m_first", "m_act"]


def comparison_rows(out_dir: Path, models: dict[str, str]) -> list[dict]:
    """`models`: folder name -> the MODEL it analysed."""
    rows = []
    for folder, model in models.items():
        arrays = np.load(Path(out_dir) / folder / "arrays.npz")
        attention = set(arrays["full_attention_layers"].tolist())
        m_sink = arrays["m_sink"].mean(axis=0) if attention else None
        m_first, m_act = arrays["m_first"].mean(axis=0), arrays["m_act_layers"].mean(axis=0)
        types = ["embedding", *arrays["layer_types"].tolist()]
        for layer in range(len(m_first)):
            rows.append({
                "model": model, "folder": folder, "layer": layer, "layer_type": types[layer], "is_attention": layer in attention,
                "m_sink": float(m_sink[layer]) if m_sink is not None else "", "m_first": float(m_first[layer]),
                "m_act": float(m_act[layer]),
            })
    return rows


def plot_comparison(rows: list[dict], path: Path) -> None:
    folders = list(dict.fromkeys(r["folder"] for r in rows))
    fig, axes = plt.subplots(1, len(folders), figsize=(3.6 * len(folders), 3.4), squeeze=False)
    for ax, folder in zip(axes[0], folders):
        mine = [r for r in rows if r["folder"] == folder]
        x = [r["layer"] for r in mine]
        if mine[0]["m_sink"] != "":
            ax.plot(x, [r["m_sink"] for r in mine], color="black", marker="o", markersize=3, label="consensus sink")
        else:
            ax.plot(x, [r["m_first"] for r in mine], color="black", linestyle="--", label="first token (no attention)")
        for i, r in enumerate(r for r in mine if r["is_attention"]):
            ax.axvline(r["layer"], color="tab:red", linestyle=":", linewidth=1, label="attention layer" if i == 0 else None)
        ax.set_title(folder, fontsize=9, parse_math=False)  # a folder named `$\x$` is a name, not mathtext
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("residual position l")
        ax.legend(fontsize=6, loc="best")
    axes[0][0].set_ylabel("max |X[l]| (mean over inputs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _headline(folder: Path) -> dict[str, str]:
    out = {}
    with open(folder / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["anchor"] in ("", "consensus_sink", "first_token") and row["metric"] in ("f_attn", "m_act", "sink_spike_alignment"):
                if row["metric"] == "sink_spike_alignment" and row["anchor"] != "consensus_sink":
                    continue
                value = float(row["mean"])
                out[row["metric"]] = "undefined" if math.isnan(value) else f"{value:.4g}"
    return out


def _quantization_rows(out_dir: Path, models: dict[str, str]) -> list[dict]:
    rows = []
    for folder, model in models.items():
        path = out_dir / folder / "quantization.csv"
        if path.is_file():
            with open(path, newline="") as f:
                rows += [{"model": model, "folder": folder, **row} for row in csv.DictReader(f)]
    return rows


def write_comparison(out_dir: Path, models: dict[str, str]) -> None:
    """`comparison.csv`, `comparison.png` and `summary.md` in `out_dir`, from its model folders."""
    out_dir = Path(out_dir)
    rows = comparison_rows(out_dir, models)
    with open(out_dir / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot_comparison(rows, out_dir / "comparison.png")
    lines = ["# Analysis of several models", "", "| model | folder | F-Attn | M-Act | sink-spike alignment |", "|---|---|---|---|---|"]
    for folder, model in models.items():
        h = _headline(out_dir / folder)
        lines.append(
            f"| `{model}` | [{folder}]({folder}/summary.md) | {h.get('f_attn', 'no attention')} | {h.get('m_act', '')} "
            f"| {h.get('sink_spike_alignment', 'no attention')} |"
        )
    quantized = _quantization_rows(out_dir, models)
    if quantized:
        with open(out_dir / "quantization.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(quantized[0]))
            writer.writeheader()
            writer.writerows(quantized)
    files = "`comparison.csv`, `comparison.png`" + (", `quantization.csv`" if quantized else "")
    lines += ["", f"Files: {files}, and each model's folder.", ""]
    (out_dir / "summary.md").write_text("\n".join(lines))
