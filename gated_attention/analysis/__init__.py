"""Attention-sink, massive-activation, gate and spike/plateau analysis of causal LMs.

- `capture`: `Capture`, hooks that record the residual states X[0..L] (before
  the final norm), eager attention maps and gate scores per forward, always
  removed on exit; `model_layout` finds the attention layers and gates of our
  models and of transformers' own.
- `metrics`: the definitions of docs/architecture.md ("Metric definitions") on
  plain arrays.
- `interventions`: `intervene`, deletion and connection on the first token,
  with the identity check.
- `samples`: the built-in inputs (prose, code and math-like text that ships
  with Python) and `--text-file` reading.
- `plots`: PNGs drawn from the written `arrays.npz`, never from live tensors.
- `analyze`: `run_analysis`, everything to `.npz`, `.csv`, `.png` and
  `summary.md`.
- `cli`: the `gated-attention analyze MODEL --out DIR` parser (no torch) and
  its run.

Imports: the package root and the layers below it (it uses the root and
`hub`); never `training`, `convert` or `recipes`, its peers and the layer
above (see docs/architecture.md). The names are imported on
first use, so that `gated_attention.analysis.cli` imports no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "metrics": None,  # a submodule
    "run_analysis": ".analyze",
    "Capture": ".capture",
    "Record": ".capture",
    "model_layout": ".capture",
    "InterventionResult": ".interventions",
    "apply_edits": ".interventions",
    "intervene": ".interventions",
}

__all__ = ["Capture", "InterventionResult", "Record", "apply_edits", "intervene", "metrics", "model_layout", "run_analysis"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f".{name}" if module is None else module, __name__)
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
