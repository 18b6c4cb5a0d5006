"""Cross-entropy as fla's fused losses compute it: what an fla model's forward with labels runs on the torch path.

fla's models take their loss from `FusedCrossEntropyLoss` (the default,
`fuse_cross_entropy=True`) or `FusedLinearCrossEntropyLoss`
(`fuse_linear_cross_entropy=True`, the LM head fused in), both Triton kernels
that refuse a CPU tensor. Their meaning, per row n with target t:

    x = logit_scale * logits[n]         (then softcap * tanh(x / softcap) with a softcap)
    lse = logsumexp(x)
    loss[n] = (1 - s) (lse - x[t]) + s (lse - mean(x)) + z[n],   z[n] = lse_square_scale * lse^2

s the label smoothing; a row whose target is `ignore_index` has loss 0. All
in fp32, as fla's kernels compute it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_cross_entropy_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    logit_softcapping: float | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[N, V]`, target `[N]` -> (loss `[N]`, z-loss `[N]`), fp32; the loss includes the z-loss, which
    comes back detached (fla's `cross_entropy_loss`)."""
    x = logits.float() * logit_scale
    if logit_softcapping is not None:
        x = logit_softcapping * torch.tanh(x / logit_softcapping)
    lse = x.logsumexp(-1)
    kept = target != ignore_index
    loss = lse - x.gather(-1, target.where(kept, 0).unsqueeze(-1)).squeeze(-1)
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(-1))
    z_loss = lse_square_scale * lse.square()
    return (loss + z_loss).where(kept, 0.0), z_loss.detach().where(kept, 0.0)


def reduced(loss: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int) -> torch.Tensor:
    """`[N]` -> as fla's losses reduce it: the sum, or the mean over the rows whose target is not ignored."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def torch_linear_cross_entropy_loss(
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcapping: float | None = None,
    reduction: str = "mean",
    use_l2warp: bool = False,
    l2_penalty_factor: float = 1e-4,
) -> torch.Tensor:
    """x `[N, D]`, target `[N]`, weight `[V, D]` -> the reduced loss (fla's `fused_linear_cross_entropy_loss`).

    L2Warp adds no value to the loss, only a gradient: `l2_penalty_factor / N` times the largest logit of each
    row, to that logit (fla's `l2_warp`). `m - m.detach()` is exactly 0 and carries that gradient.
    """
    logits = F.linear(x, weight, bias)  # [N, V]
    loss, _ = torch_cross_entropy_loss(logits, target, label_smoothing=label_smoothing, logit_scale=logit_scale,
                                       logit_softcapping=logit_softcapping, ignore_index=ignore_index)
    loss = reduced(loss, target, reduction, ignore_index)
    if use_l2warp:
        top = logits.float().max(-1).values
        loss = loss + (top.detach() * l2_penalty_factor / logits.shape[0] * (top - top.detach())).sum()
    return loss
