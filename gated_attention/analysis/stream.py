"""Windowed perplexity over one long text through StreamingLLM's cache (`SinkCache`), per number of sink tokens.

StreamingLLM (Xiao et al. 2023) streams a text one token at a time through a cache of `window` entries and
reports perplexity: without sinks the window evicts the first token, and a model that parks attention there
breaks; keeping a few first tokens restores it. A sink-free model should not need them. `windowed_nll` is
that stream: the first `window` tokens in one forward (nothing is evicted before the cache holds `window`
entries, so one forward attends as single tokens would), then one token at a time. `full_attention_nll`
is the reference without a window: the same tokens with every earlier token in view, `window` at a time
through transformers' `DynamicCache`, so memory grows with `window x tokens`, never `tokens x tokens`.

Files (`write_stream`): `stream.npz` (the text's token ids and each run's per-token negative log-likelihood
in nats: `nll_sinks_K`, `nll_full`), `stream.csv` (sink_tokens, window, tokens, ppl: one row per sink count;
`tokens` is the length of the stream, ppl = exp of the mean NLL of its tokens after the first) and
`stream.png`, drawn from `stream.npz`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..compat import CACHE_NAME
from ..modeling.sink_cache import SinkCache
from .loading import check_token_ids

COLUMNS = ("sink_tokens", "window", "tokens", "ppl")


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`[T, V]` logits and the `[T]` tokens they predict -> `[T]` negative log-likelihoods (float32 softmax)."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def windowed_nll(model, ids: torch.Tensor, window: int, sinks: int, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """`ids` `[1, T]` streamed through `SinkCache(window, sinks)`: the NLL of tokens 1..T-1, `[T - 1]` float64."""
    cache = SinkCache(window, sinks, config=model.config)
    prefix = min(window, ids.shape[1])
    logits = model(ids[:, :prefix], use_cache=True, **{CACHE_NAME: cache}).logits[0]  # [prefix, V]
    nll = [_nll(logits[:-1], ids[0, 1:prefix])]
    last = logits[-1:]
    if progress:
        progress(prefix)
    for t in range(prefix, ids.shape[1]):
        nll.append(_nll(last, ids[0, t : t + 1]))
        last = model(ids[:, t : t + 1], use_cache=True, **{CACHE_NAME: cache}).logits[0]
        if progress:
            progress(1)
    return torch.cat(nll).double().cpu().numpy()


@torch.no_grad()
def full_attention_nll(model, ids: torch.Tensor, chunk: int, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """`ids` `[1, T]` with every earlier token in view, `chunk` tokens per forward: `[T - 1]` float64."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    for start in range(0, ids.shape[1], chunk):
        logits.append(model(ids[:, start : start + chunk], use_cache=True, **{CACHE_NAME: cache}).logits[0])
        if progress:
            progress(min(chunk, ids.shape[1] - start))
    return _nll(torch.cat(logits)[:-1], ids[0, 1:]).double().cpu().numpy()


def learned_positions(model) -> int | None:
    """How many positions the model has where they are rows of a table, its `max_position_embeddings`: an embedding
    of that many rows beside the tokens' (GPT-2's `wpe`, OPT's with its offset of 2) or a buffer of positions
    (GPT-J's sin/cos `embed_positions`). None where positions are computed (RoPE, ALiBi) or there are none.

    A stream gives its tokens their positions in the text, so a text longer than the table has no position for
    its later tokens (IndexError in the model)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = [module.num_embeddings for module in model.modules() if isinstance(module, torch.nn.Embedding) and module is not tokens]
    rows += [buffer.shape[0] for name, buffer in model.named_buffers() if name.endswith("embed_positions") and buffer.dim() == 2]
    return limit if any(limit <= n <= limit + 2 for n in rows) else None


def perplexity(nll: np.ndarray) -> float:
    return math.exp(float(np.mean(nll)))


def write_stream(out: Path, ids: np.ndarray, window: int, nll_by_sinks: dict[int, np.ndarray], nll_full: np.ndarray | None,
                 model_name: str) -> list[dict]:
    """`stream.npz`, `stream.csv` and `stream.png` in `out`; returns the CSV's rows."""
    arrays = {"input_ids": ids, "window": np.array(window)}
    arrays.update({f"nll_sinks_{k}": v for k, v in nll_by_sinks.items()})
    if nll_full is not None:
        arrays["nll_full"] = nll_full
    np.savez(out / "stream.npz", **arrays)
    rows = [{"sink_tokens": k, "window": window, "tokens": len(ids), "ppl": perplexity(v)} for k, v in nll_by_sinks.items()]
    with open(out / "stream.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({**row, "ppl": f"{row['ppl']:.6g}"} for row in rows)
    plot_stream(out / "stream.npz", out / "stream.png", title=model_name)
    return rows


def plot_stream(npz: Path, png: Path, title: str = "") -> None:
    """Per-token NLL along the text (a running mean), one line per sink count, full attention dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = np.load(npz)
    window = int(data["window"])
    runs = sorted((int(name.removeprefix("nll_sinks_")), data[name]) for name in data.files if name.startswith("nll_sinks_"))
    span = max(8, len(data["input_ids"]) // 64)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, nll, style in [*((f"{k} sink tokens (ppl {perplexity(v):.4g})", v, "-") for k, v in runs),
                              *([("full attention (ppl %.4g)" % perplexity(data["nll_full"]), data["nll_full"], "--")]
                                if "nll_full" in data.files else [])]:
        smooth = np.convolve(nll, np.ones(span) / span, mode="valid")
        ax.plot(np.arange(len(smooth)) + span, smooth, style, label=label)
    ax.axvline(window, color="grey", linestyle=":", label=f"window ({window}): evictions start")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel(f"NLL, mean over {span} tokens (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


class _no_bar:
    def __init__(self, total: int, description: str):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def run_stream(model, ids: torch.Tensor, window: int, sink_counts: Sequence[int], out: Path, model_name: str,
               bar=None) -> tuple[list[dict], float | None]:
    """Every sink count's stream, then full attention (where the text fits the model's positions), to `out`.

    `bar(total, description)` makes a progress bar (a context manager with `update(n)`); None: no bar.
    Returns the CSV rows and the full-attention perplexity (None when the text is longer than the model's
    `max_position_embeddings`: past them a full forward extrapolates and measures something else).
    """
    bar = bar or _no_bar
    tokens = ids.shape[1]
    check_token_ids(model, int(ids.max()), model_name)
    if (limit := learned_positions(model)) is not None and tokens > limit:
        raise ValueError(f"the text gives {tokens} tokens, and the model's positions are learned up to {limit} "
                         f"(max_position_embeddings): stream at most {limit} tokens (--max-tokens {limit})")
    for sinks in sink_counts:  # every count's refusal before any stream runs
        SinkCache(window, sinks, config=model.config)
    nll_by_sinks = {}
    for sinks in sink_counts:
        with bar(tokens, f"window {window}, {sinks} sinks") as b:
            nll_by_sinks[sinks] = windowed_nll(model, ids, window, sinks, progress=b.update)
    nll_full = None
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is None or tokens <= limit:
        with bar(tokens, "full attention") as b:
            nll_full = full_attention_nll(model, ids, window, progress=b.update)
    rows = write_stream(out, ids[0].cpu().numpy(), window, nll_by_sinks, nll_full, model_name)
    return rows, None if nll_full is None else perplexity(nll_full)
