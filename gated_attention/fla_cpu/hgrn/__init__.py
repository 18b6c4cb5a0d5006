"""HGRN's gated linear recurrence, in chunked torch.

Layout and meaning are fla's (`fla.ops.hgrn`); the reference it is tested against is fla's
`fla/ops/hgrn/naive.py`.

- `chunk`: `torch_hgrn`.

Re-exported here: `torch_hgrn`.
"""

from .chunk import torch_hgrn
