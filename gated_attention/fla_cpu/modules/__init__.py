"""The torch twins of what fla's layers call besides an op (fla keeps these flat in `fla/modules/`).

- `short_convolution`: fla's causal depthwise convolution and its decode step.
- `norms`: fla's fused RMSNorm / LayerNorm, with residual, gate and linear.
- `rotary`: fla's rotary embedding.
- `cross_entropy`: fla's fused cross-entropy losses (a forward with labels).
- `softmax_attention`: causal softmax attention returning its weights, what
  fla's `Attention` layer runs instead of flash-attn.

`torch_paths` points fla's names at these; nothing is re-exported here.
"""
