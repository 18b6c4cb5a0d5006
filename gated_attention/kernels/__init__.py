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

The torch paths of the layers in fla's models (one op per file, fla's
`[B, T, H, K]` layout and argument names, each tested against fla's
`fla/ops/*/naive.py`), and the context manager that points fla's layers at them:

- `fla_paths`: `fla_torch_paths()`: while open, fla's layers on CPU tensors
  run the files below, and fla's softmax `Attention` returns its weights.
- `gla`: gated linear attention (a decay per key channel; HGRN2 too).
- `simple_gla`: simple GLA (a decay per head) and RetNet's retention.
- `hgrn`: HGRN's gated linear recurrence.
- `delta_rule`: DeltaNet's delta rule (the gated delta rule without decay).
- `kda`: Kimi Delta Attention (the delta rule with a decay per key channel).
- `short_convolution`: fla's causal depthwise convolution and its decode step.
- `norms`: fla's fused RMSNorm / LayerNorm, with residual, gate and linear.
- `rotary`: fla's rotary embedding.
- `softmax_attention`: causal softmax attention returning its weights.
- `cross_entropy`: fla's fused cross-entropy losses (a forward with labels).
- `chunking`: chunk sizes, the chunk-major layout, packed sequences.

Imports: `compat` at most, never a model (see docs/architecture.md). triton
and fla are imported inside `try:` or inside functions, so the remote-code
copies load where they are missing. `gated_sdpa`, `gated_delta_rule` and
`fla_torch_paths` are re-exported here.
"""

from .fla_paths import fla_torch_paths
from .gated_delta_rule import gated_delta_rule
from .gated_sdpa import gated_sdpa
