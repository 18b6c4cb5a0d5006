"""Quantized gated models: compressed-tensors' schemes applied to a model, and what each costs it.

- `schemes`: compressed-tensors' preset schemes by name (`W8A8`, `W4A16`, `FP8`, `NVFP4`, `MXFP4`, ...), the
  check that a scheme's groups and blocks tile every layer it rounds, and the one-line errors (an unknown name,
  compressed-tensors missing).
- `rounding`: a scheme applied to chosen linear maps of a copy of a model, or to some output rows of one (a fused
  projection's gate rows), with min-max scales: compressed-tensors' own initialisation, rounding and forward;
  weights per the scheme's strategy, static activation and global scales from calibration inputs. The same state
  `ModelCompressor` compresses and saves (`recipes/quantize.py`).
- `targets`: which linear maps each arm rounds (`all`, `gates_kept`, `gates_only`, and for a gate fused into
  `q_proj`, `gate_rows_only` and `query_rows_only`), read from `modeling.gate_sites`, and the gate patterns of
  every gate the package knows;
- `ignore`: the ignore lists the ecosystem's quantizers take for keeping the gates, as text (the converted and
  exported models' cards carry them without importing the models).
- `measure`: each arm against the unquantized model on the same inputs (perplexity, mean KL of the next-token
  distributions, top-1 agreement, bytes), and the outlier statistics of the inputs to each attention output
  projection, MLP down projection and gate (kurtosis, max/median magnitude).

Imports: torch, compressed-tensors (on first use; a checkpoint that is not quantized needs none of this),
`modeling` (the gate sites) and the layers below it; never `analysis`, `convert`, `training` or `recipes`, which
use it (see docs/architecture.md).
"""
