"""Attention and delta-rule kernels, each with a plain-torch path beside it: one folder per op family, as
fla keeps its ops (`fla/ops/<op>/`).

Our own kernel:

- `gated_sdpa/`: gated softmax attention. `gated_sdpa(q, k, v, gate)` runs the
  Triton kernels on CUDA tensors (or under `TRITON_INTERPRET=1`) and the torch
  reference everywhere else; the gate's activations; the
  `attn_implementation="gated_triton"` registration. Its `__init__` maps its files.

The torch paths of the ops in fla's models (fla's `[B, T, H, K]` layout and
argument names, each tested against fla's `fla/ops/*/naive.py`), one folder per
op family, each holding `chunk.py`, the chunked torch implementation:

- `gated_delta_rule/`: `gated_delta_rule(q, k, v, g, beta)` in fla's layout:
  fla's kernels on CUDA tensors, a chunked torch implementation elsewhere
  (a recurrent step for a single position). The models' Gated DeltaNet runs it.
- `delta_rule/`: DeltaNet's delta rule (the gated delta rule without decay).
- `kda/`: Kimi Delta Attention (the delta rule with a decay per key channel).
- `gla/`: gated linear attention (a decay per key channel; HGRN2 too).
- `simple_gla/`: simple GLA (a decay per head) and RetNet's retention.
- `hgrn/`: HGRN's gated linear recurrence.
- `fla_modules/`: the pieces fla's layers call besides an op, as fla keeps
  them flat in `fla/modules/`: short convolution, norms, rotary, cross-entropy,
  and the softmax attention that stands in for flash-attn.

Shared by them, here:

- `chunking`: chunk sizes, the chunk-major layout, packed sequences: what
  every chunked op folder above uses.
- `fla_paths`: `fla_torch_paths()`, the switch: while open, fla's layers on
  CPU tensors run the torch paths above, and fla's softmax `Attention` returns
  its weights.

`gated_sdpa`, `gated_delta_rule` and `fla_torch_paths` are re-exported here. So
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

from .fla_paths import fla_torch_paths
from .gated_delta_rule.chunk import gated_delta_rule
from .gated_sdpa.dispatch import gated_sdpa
