"""The gated delta rule (Gated DeltaNet): fla's kernels on CUDA, chunked torch elsewhere.

Layout and meaning are fla's (`fla.ops.gated_delta_rule`); the reference it is tested against is fla's
`fla/ops/gated_delta_rule/naive.py`.

- `chunk`: `gated_delta_rule`, the dispatcher by device, and its torch path
  `torch_gated_delta_rule` (chunked; a recurrent step for a single position).

Re-exported here: `gated_delta_rule`, `torch_gated_delta_rule`.
"""

from .chunk import gated_delta_rule, torch_gated_delta_rule
