"""Attention-sink, massive-activation, gate and spike/plateau analysis of causal LMs.

- `Capture`: hooks recording residual states X[0..L] (pre final norm), eager
  attention maps and gate scores per forward; always removed on exit.
- `metrics`: the definitions of DESIGN.md on plain arrays.
- `intervene`: deletion / connection on the first token, with the identity check.
- `run_analysis`: everything to `.npz`, `.csv`, `.png` and `summary.md`
  (`gated-attention analyze MODEL --out DIR`).
"""

from . import metrics
from .analyze import run_analysis
from .capture import Capture, Record, model_layout
from .interventions import InterventionResult, apply_edits, intervene

__all__ = ["Capture", "InterventionResult", "Record", "apply_edits", "intervene", "metrics", "model_layout", "run_analysis"]
