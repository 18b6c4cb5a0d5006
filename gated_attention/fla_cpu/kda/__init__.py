"""Kimi Delta Attention (the delta rule with a decay per key channel), in chunked torch.

Layout and meaning are fla's (`fla.ops.kda`); the reference it is tested against is fla's
`fla/ops/kda/naive.py`.

- `chunk`: `torch_kda` and `kda_gate`, KDA's decay from its gate inputs.

Re-exported here: `kda_gate`, `torch_kda`.
"""

from .chunk import kda_gate, torch_kda
