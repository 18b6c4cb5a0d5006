"""Gated SDPA, `softmax(q k^T * scale) v * act(gate)`: the Triton kernels and their torch reference.

- `dispatch`: `gated_sdpa(q, k, v, gate)`, the dispatcher. It runs the Triton
  kernels on CUDA tensors (or under `TRITON_INTERPRET=1`) and the reference
  everywhere else, and logs once which path runs.
- `reference`: the plain-torch reference, SDPA and then the gate,
  with a bottom-right causal mask.
- `triton`: the Triton kernels, forward, backward, packed
  sequences and a split-KV decode path, with the gate fused into the epilogue.
- `gate_activations`: the gate's activation functions by name (`sigmoid`,
  `ns_sigmoid`, `silu`) and the ones the fused kernels take.
- `sinks`: `sdpa_with_sinks`, transformers' SDPA with GPT-OSS's learned sinks
  (one more all-zero key whose logit is the sink), the torch path beside the
  kernels' own sinks.
- `attention_interface`: registers `attn_implementation="gated_triton"` with
  transformers' attention and mask interfaces (on import, so it is not
  imported here).

`gated_sdpa` and `gated_sdpa_reference` are re-exported here.
"""

from .dispatch import gated_sdpa
from .reference import gated_sdpa_reference
