"""Attention-sink, massive-activation, gate and spike/plateau analysis of causal LMs.

- `layout`: `model_layout`, the decoder layers, softmax-attention modules and
  gates of a model, read from its `_can_record_outputs` declaration (through
  `modeling/recorded_outputs`, the reader the declared gate shares): the mechanism.
- `model_records`: what declarations do not say, per model type or class, as data
  (classes that predate the declaration, models refused and why, output gates),
  and the `View` each model's residual states and attention maps are read
  through, picked once when the layout is read.
- `capture`: `Capture`, hooks that record the residual states X[0..L] (before
  the final norm), eager attention maps and gate scores per forward (or reduce
  them as they are produced), always removed on exit; each attention call is
  attributed to the decoder layer that made it.
- `metrics`: the definitions of docs/architecture.md ("Metric definitions") on
  plain arrays.
- `interventions`: `intervene`, deletion, set-to-mean and connection on the
  first token (or chosen tokens and residual positions), with the identity check.
- `samples`: the built-in inputs (prose, code and math-like text that ships
  with Python), `--text-file` reading and `--dataset` inputs per domain.
- `plots`: PNGs drawn from the written `arrays.npz`, never from live tensors.
- `analyze`: `run_analysis`: check the inputs, capture them, the metrics per
  input and over inputs, the interventions.
- `tables`: the files `run_analysis` writes, one writer each: `arrays.npz`, the
  `.csv` tables and `summary.md`.
- `compare`: several models' analyses side by side (`comparison.csv`,
  `comparison.png`), drawn from their written arrays.
- `loading`: how `analyze` and `stream` load a MODEL (`LoadOptions`):
  transformers' own class for its model types, fla's models inside
  `fla_torch_paths`, accelerate's placement within the memory budget.
- `command_checks`: what `analyze` and `stream` check before torch loads
  (MODEL names, --out, MODEL's whereabouts and config) and their staged
  output folder.
- `cli`: the `gated-attention analyze MODEL --out DIR` parser (no torch) and
  its run.
- `stream`: StreamingLLM's measurement, windowed perplexity over one text
  through `SinkCache` per number of sink tokens, and its CSV, arrays and plot.
- `stream_cli`: the `gated-attention stream MODEL --text-file F --window W
  --out DIR` parser (no torch) and its run.

Imports: the package root and the layers below it (it uses the root,
`modeling`, `hub`, `files`, `memory`, `kernels` and `cli_common`); never `training`,
`convert` or `recipes`, its peers and the layer above (see
docs/architecture.md). The names are imported on
first use, so that `gated_attention.analysis.cli` imports no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "metrics": None,  # a submodule
    "run_analysis": ".analyze",
    "Capture": ".capture",
    "Record": ".capture",
    "model_layout": ".layout",
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
