"""The package's own kernels, each a fast path beside its plain-torch path: one folder per op family, as fla
keeps its ops (`fla/ops/<op>/`).

- `gated_sdpa/`: gated softmax attention. `gated_sdpa(q, k, v, gate)` runs the
  Triton kernels on CUDA tensors (or under `TRITON_INTERPRET=1`) and the torch
  reference everywhere else; the gate's activations; the
  `attn_implementation="gated_triton"` registration. Its `__init__` maps its files.
- `gated_delta_rule/`: `gated_delta_rule(q, k, v, g, beta)` in fla's layout
  (`[B, T, H, K]`, g in log space): fla's kernels on CUDA tensors, a chunked
  torch implementation elsewhere (a recurrent step for a single position),
  tested against fla's `fla/ops/gated_delta_rule/naive.py`. The models' Gated
  DeltaNet runs it.
- `chunking`: chunk sizes, the chunk-major layout, packed sequences: what the
  chunked torch path of `gated_delta_rule` is cut by (and, one floor up, the
  torch paths of fla's other ops in `fla_cpu`).

`gated_sdpa` and `gated_delta_rule` are re-exported here. So
`gated_attention.kernels.gated_sdpa` and `gated_attention.kernels.gated_delta_rule`
are the functions, which hide their folders of the same name as attributes:
reach a module there with `from gated_attention.kernels.gated_sdpa import triton`
or `from gated_attention.kernels.gated_sdpa.triton import ...`, not with
`import gated_attention.kernels.gated_sdpa.triton as m` (or a dotted
monkeypatch target), which walk the attributes.

Imports: `compat` at most, never a model (see docs/architecture.md). triton
and fla are imported inside `try:` or inside functions, so the remote-code
copies load where they are missing. Modules import each other's files
(`from ..chunking import x`, `from .reference import y`), never a folder's
`__init__`: the remote-code bundle copies files, not `__init__`s.
"""

from .gated_delta_rule.chunk import gated_delta_rule
from .gated_sdpa.dispatch import gated_sdpa
