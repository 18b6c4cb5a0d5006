"""Attention and delta-rule kernels, each with a plain-torch path beside it.

- `gated_sdpa`: `gated_sdpa(q, k, v, gate)`, the dispatcher. It runs the Triton
  kernels on CUDA tensors (or under `TRITON_INTERPRET=1`) and the reference
  everywhere else, and logs once which path runs.
- `gated_sdpa_reference`: the plain-torch reference, SDPA and then the gate,
  with a bottom-right causal mask.
- `gated_sdpa_triton`: the Triton kernels, forward, backward, packed
  sequences and a split-KV decode path, with the gate fused into the epilogue.
- `gate_activations`: the gate's activation functions by name (`sigmoid`,
  `ns_sigmoid`, `silu`) and the ones the fused kernels take.
- `attention_interface`: registers `attn_implementation="gated_triton"` with
  transformers' attention and mask interfaces.
- `gated_delta_rule`: `gated_delta_rule(q, k, v, g, beta)` in fla's layout:
  fla's kernels on CUDA tensors, a chunked torch implementation elsewhere
  (a recurrent step for a single position).
- `chunking`: chunk sizes, the chunk-major layout, packed sequences.

Imports: `compat` at most, never a model (see docs/architecture.md). triton
and fla are imported inside `try:`, so the remote-code copies load where they
are missing. `gated_sdpa` and `gated_delta_rule` are re-exported here.
"""

from .gated_delta_rule import gated_delta_rule
from .gated_sdpa import gated_sdpa
