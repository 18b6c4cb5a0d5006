"""The delta rule (DeltaNet): the gated delta rule without decay, on `torch_gated_delta_rule`.

Layout and meaning are fla's (`fla.ops.delta_rule`). Per head, with the state S
`[K, V]` starting at `initial_state` (or zeros), for t = 1..T:

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t

That is the gated delta rule with g = 0 (exp(g) = 1), so the chunked torch
path is the package's own (`gated_delta_rule.torch_gated_delta_rule`, given
g = None, which skips the decay factors). fla's
reference is `fla/ops/delta_rule/naive.py` (`delta_rule_recurrence`, in the
older `[B, H, T, K]` layout).
"""

from __future__ import annotations

import torch

from ...kernels.gated_delta_rule.chunk import torch_gated_delta_rule


def torch_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the delta rule: q, k `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`; returns
    `(o [B, T, H, V], final_state [N, H, K, V] or None)`. The keyword `options` are `torch_gated_delta_rule`'s
    (scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens), as fla's op takes them."""
    return torch_gated_delta_rule(q, k, v, None, beta, **options)
