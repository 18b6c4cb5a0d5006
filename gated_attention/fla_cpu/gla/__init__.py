"""Gated linear attention (a decay per key channel and step), in chunked torch; HGRN2 runs on it too.

Layout and meaning are fla's (`fla.ops.gla`); the reference it is tested against is fla's
`fla/ops/gla/naive.py`.

- `chunk`: `torch_gla` and `decayed_scores`, the per-channel decayed scores KDA reuses.

Re-exported here: `decayed_scores`, `torch_gla`.
"""

from .chunk import decayed_scores, torch_gla
