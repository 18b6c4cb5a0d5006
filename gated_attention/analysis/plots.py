"""Plots drawn from the files `run_analysis` writes (`arrays.npz`), never from live tensors.

- `trajectory.png`: first-token max |activation| over depth (x = residual
  position l, 0 = embeddings), one thin line per input, the mean in bold,
  attention layers f marked by dotted lines (their input, the pre-attention
  position f-1, is where the massive-activations paper's spikes sit).
- `first_token_attention.png`: mean attention on token 0 per attention layer,
  per-head means as dots.
- `gate_hist.png`: gate-score histogram pooled over the gated layers (only when
  the model has gates).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display is ever needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _mark_attention_layers(ax, attention_layers) -> None:
    for i, f in enumerate(attention_layers):
        ax.axvline(f, color="tab:red", linestyle=":", linewidth=1, label="attention layer" if i == 0 else None)


def plot_trajectory(arrays, path: Path) -> None:
    m, domains = arrays["m_first"], arrays["domain"]
    x = np.arange(m.shape[1])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    colors = {d: f"C{i}" for i, d in enumerate(dict.fromkeys(domains.tolist()))}
    for row, domain in zip(m, domains):
        ax.plot(x, row, color=colors[domain], alpha=0.35, linewidth=0.8)
    for domain, color in colors.items():
        ax.plot([], [], color=color, label=domain)
    ax.plot(x, m.mean(axis=0), color="black", linewidth=2, label="mean")
    _mark_attention_layers(ax, arrays["full_attention_layers"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("residual position l (0 = embeddings, l = output of layer l)")
    ax.set_ylabel("first token max |X[l]|")
    ax.set_title("First-token max-activation trajectory")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_first_token_attention(arrays, path: Path) -> None:
    attention, layers = arrays["first_token_attention"], arrays["attention_rows"][:, 0]  # [N, n_attn, H]; each row's layer
    # A layer with fewer heads than the most is NaN-padded in every input (Inkling2): its missing heads stay NaN.
    present = ~np.isnan(attention).all(axis=0)  # [n_attn, H]
    per_head = np.full(attention.shape[1:], np.nan)
    per_head[present] = np.nanmean(attention[:, present], axis=0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for j, f in enumerate(layers):
        ax.scatter(np.full(per_head.shape[1], f), per_head[j], s=8, color="tab:blue", alpha=0.5)
    ax.plot(layers, np.nanmean(per_head, axis=1), color="black", marker="o", label="mean over heads")
    ax.scatter([], [], s=8, color="tab:blue", label="head")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("attention layer (1-based)")
    ax.set_ylabel("attention on token 0 (queries ≥ 1)")
    ax.set_title("First-token attention per layer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gate_histogram(arrays, path: Path) -> None:
    edges, counts = arrays["gate_hist_edges"], arrays["gate_hist_counts"].sum(axis=0)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(edges[:-1], counts / max(counts.sum(), 1), width=np.diff(edges), align="edge", color="tab:green")
    ax.set_xlabel("gate score (clipped to [0, 1])")
    ax.set_ylabel("fraction of scores")
    ax.set_title(f"Gate scores, layers {arrays['gate_layers'].tolist()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_all(out_dir: str | Path) -> list[str]:
    """Draw every plot the data in `out_dir/arrays.npz` supports; return the file names written."""
    out_dir = Path(out_dir)
    arrays = np.load(out_dir / "arrays.npz")
    written = ["trajectory.png"]
    plot_trajectory(arrays, out_dir / "trajectory.png")
    if arrays["first_token_attention"].size and not np.isnan(arrays["first_token_attention"]).all():
        plot_first_token_attention(arrays, out_dir / "first_token_attention.png")
        written.append("first_token_attention.png")
    if arrays["gate_layers"].size:
        plot_gate_histogram(arrays, out_dir / "gate_hist.png")
        written.append("gate_hist.png")
    return written
