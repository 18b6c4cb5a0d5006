"""fla's own models on a CPU: torch stand-ins for flash-linear-attention's Triton kernels and for flash-attn.

fla imports on a machine without a GPU and then fails in its first kernel;
its softmax attention layer cannot even be built without flash-attn. Inside
`fla_torch_paths()` its layers run the torch paths here on CPU tensors (and
its attention returns its weights on every device). One folder per op family,
as fla keeps `fla/ops/<op>/`, each holding `chunk.py`, the chunked torch
implementation in fla's `[B, T, H, K]` layout and argument names, tested
against fla's `fla/ops/*/naive.py`:

- `delta_rule/`: DeltaNet's delta rule (the gated delta rule without decay).
- `kda/`: Kimi Delta Attention (the delta rule with a decay per key channel).
- `gla/`: gated linear attention (a decay per key channel; HGRN2 too).
- `simple_gla/`: simple GLA (a decay per head) and RetNet's retention.
- `hgrn/`: HGRN's gated linear recurrence.
- `modules/`: the pieces fla's layers call besides an op, as fla keeps them
  flat in `fla/modules/`: short convolution, norms, rotary, cross-entropy, and
  the softmax attention that stands in for flash-attn.

Beside them:

- `chunking`: what these paths add to `kernels.chunking` (chunk lengths under
  a decay per channel, fla's layout of a recurrent state).
- `attention_layer`: fla's softmax `Attention` with its flash-attn calls
  answered in torch, around its own forward, returning its weights.
- `torch_paths`: `fla_torch_paths()`, the switch that points fla's names at the
  paths above while it is open.

Gated DeltaNet's op is the package's own kernel, `kernels.gated_delta_rule`,
which the switch points fla's Gated DeltaNet at too. Re-exported here:
`fla_torch_paths`.

Imports: `kernels` (the chunk layout, the gated delta rule) and the floor below
it, nothing above (see docs/architecture.md). fla is never imported here: the
switch patches it only where the process has imported it.
"""

from .torch_paths import fla_torch_paths
