"""Simple gated linear attention (one decay per head and step) and RetNet's retention, in chunked torch.

Layout and meaning are fla's (`fla.ops.simple_gla`); the reference it is tested against is fla's
`fla/ops/simple_gla/naive.py`.

- `chunk`: `torch_simple_gla`, `torch_retention` and `retention_decay`, RetNet's decay per head.

Re-exported here: `retention_decay`, `torch_retention`, `torch_simple_gla`.
"""

from .chunk import retention_decay, torch_retention, torch_simple_gla
