"""The delta rule (DeltaNet) in torch: the gated delta rule without decay.

Layout and meaning are fla's (`fla.ops.delta_rule`); the reference it is tested against is fla's
`fla/ops/delta_rule/naive.py`.

- `chunk`: `torch_delta_rule`, on the package's own `kernels.gated_delta_rule.chunk.torch_gated_delta_rule`.

Re-exported here: `torch_delta_rule`.
"""

from .chunk import torch_delta_rule
