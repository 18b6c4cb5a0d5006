"""Router losses of the sparse MoE block, and load balancing over the global batch.

Routing (see `moe.py`): `p = softmax(x W_r^T)` in fp32, top-k experts per token.

Losses, over the L sparse layers and the N real (non-padding) tokens:

    f_e = 1/(L N) sum_l #{t : e in topk_l(t)}      (counts; no gradient)
    P_e = 1/(L N) sum_l sum_t p_l(t)_e
    load balancing  LBL = E * sum_e f_e P_e        (k when routing is uniform)
    z-loss          Z   = 1/(L N) sum_l sum_t logsumexp_e(z_l(t)_e) ** 2    (ST-MoE)

LBL is pooled over layers exactly as transformers' Qwen3-MoE computes its
`aux_loss`, so the two agree on one batch.

Global-batch load balancing
---------------------------
The Gated Attention paper trains with the global-batch load-balancing loss (Qiu et al. 2025,
"Demons in the detail"): f is counted over the global batch (every
gradient-accumulation micro-batch on every data-parallel rank), not per
micro-batch, which leaves experts free to specialise by domain. Since f has no
gradient, only the counts have to cross micro-batches and ranks; each P keeps
its gradient where it was computed. `GlobalLoadBalancer` does the bookkeeping.
A training loop feeds it like this:

    balancer = GlobalLoadBalancer.from_config(model.config)  # group=: the data-parallel group (default: world)
    for batch in loader:                                       # one optimizer step
        for mb in micro_batches(batch):                        # gradient accumulation
            out = model(**mb, output_router_logits=True, load_balancer=balancer)  # mb has labels
            (out.loss / len(micro_batches)).backward()         # LM + coef * LBL + z-coef * Z
        optimizer.step(); optimizer.zero_grad()
        with torch.no_grad():
            log(balancer.loss())                               # this rank's share of the step's exact LBL
        balancer.reset()

Each call of the balancer (the model makes it when given `load_balancer=`;
without a model, call `balancer(out.router_logits, attention_mask)`)
all-reduces the micro-batch's counts over the ranks when torch.distributed is
initialised, adds them to the step's running counts, and returns
`E * sum_e f_e P_e` with f from every micro-batch seen so far in the step and P
from this micro-batch (scaled so that the average over ranks, which DDP and
FSDP take of gradients, is the P of this micro-batch over all ranks). The last
micro-batch of a step thus sees the global f exactly and earlier ones a prefix
of it: f is only known after the last forward, and a loop that backpropagates
each micro-batch before the next cannot wait for it.

For the exact global-batch gradient, keep the micro-batches' graphs and
backpropagate once, with `GlobalLoadBalancer(..., deferred=True)`: its calls
then return 0 (so `out.loss` holds LM + z-loss only) and the loss goes in at
the end:

    loss = sum(model(**mb, output_router_logits=True, load_balancer=balancer).loss for mb in mbs) / len(mbs)
    (loss + model.config.router_aux_loss_coef * balancer.loss()).backward()

`balancer.loss()` is always the exact global-batch LBL of the micro-batches
seen since `reset()`, as this rank's share: its mean over ranks is the loss of
the global batch, whatever the number of real tokens on each rank.

This module needs torch alone, so any training framework can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _token_weights(token_mask: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor:
    """Per-row weights `[N]` (1 = real token, 0 = padding) for router logits of N = B * T rows."""
    if token_mask is None:
        return torch.ones(num_rows, dtype=torch.float32, device=device)
    weights = token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if weights.numel() != num_rows:
        raise ValueError(f"token mask has {weights.numel()} entries but the router saw {num_rows} tokens")
    return weights


@dataclass
class RouterStatistics:
    """What one micro-batch contributes to the load-balancing loss (L sparse layers, E experts)."""

    counts: torch.Tensor  # [L, E] top-k assignments of real tokens; no gradient
    prob_sums: torch.Tensor  # [L, E] router probabilities summed over real tokens; differentiable
    num_tokens: torch.Tensor  # [] real tokens


def router_statistics(
    router_logits: tuple[torch.Tensor, ...], top_k: int, token_mask: torch.Tensor | None = None
) -> RouterStatistics:
    """Counts and probability sums from each sparse layer's router logits `[N, E]`.

    `token_mask` (`[B, T]` or `[N]`, 1 = real token) leaves padding out. Layers
    are processed one at a time, so memory stays O(N * E) whatever L is.
    """
    device = router_logits[0].device
    num_rows, num_experts = router_logits[0].shape
    weights = _token_weights(token_mask, num_rows, device)
    counts, prob_sums = [], []
    for logits in router_logits:
        probs = torch.softmax(logits.to(device).float(), dim=-1)  # [N, E]
        with torch.no_grad():
            chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)  # [N * k], token-major
            count = torch.zeros(num_experts, dtype=torch.float32, device=device)
            counts.append(count.scatter_add_(0, chosen, weights.repeat_interleave(top_k)))
        prob_sums.append((probs * weights[:, None]).sum(0))
    return RouterStatistics(torch.stack(counts), torch.stack(prob_sums), weights.sum())


def pooled_load_balancing_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: torch.Tensor | float
) -> torch.Tensor:
    """`E * sum_e f_e P_e` with f and P pooled over the layers of `counts` / `prob_sums` `[L, E]`."""
    num_layers, num_experts = counts.shape
    f = counts.sum(0) / (num_layers * num_tokens)
    p = prob_sums.sum(0) / (num_layers * num_tokens)
    return num_experts * (f * p).sum()


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The load-balancing loss of one batch (transformers' Qwen3-MoE `aux_loss`); 0 without sparse layers."""
    if not router_logits:
        return torch.zeros(())
    stats = router_statistics(router_logits, top_k, token_mask)
    return pooled_load_balancing_loss(stats.counts, stats.prob_sums, stats.num_tokens)


def router_z_loss(router_logits: tuple[torch.Tensor, ...], token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's z-loss: mean over sparse layers and real tokens of `logsumexp(z) ** 2`; 0 without sparse layers.

    Squared as in ST-MoE, which the Gated Attention paper cites for it.
    """
    if not router_logits:
        return torch.zeros(())
    device = router_logits[0].device
    weights = _token_weights(token_mask, router_logits[0].shape[0], device)
    total = sum((torch.logsumexp(z.to(device).float(), dim=-1) ** 2 * weights).sum() for z in router_logits)
    return total / (len(router_logits) * weights.sum())


class GlobalLoadBalancer:
    """Load-balancing loss over the global batch: micro-batches of one optimizer step, on every rank.

    See the module docstring for how a training loop feeds it. `group` is the
    data-parallel process group (None: the default group); counts are summed
    over it when torch.distributed is initialised. Call `reset()` after each
    optimizer step.
    """

    def __init__(self, num_experts: int, top_k: int, *, group=None, deferred: bool = False):
        self.num_experts = num_experts
        self.top_k = top_k
        self.group = group
        self.deferred = deferred
        self.reset()

    @classmethod
    def from_config(cls, config, **kwargs) -> GlobalLoadBalancer:
        return cls(config.num_experts, config.num_experts_per_tok, **kwargs)

    def reset(self) -> None:
        self.counts: torch.Tensor | None = None  # [L, E] summed over ranks and micro-batches
        self.num_tokens: torch.Tensor | None = None  # [] likewise
        self._local_prob_sums: list[torch.Tensor] = []  # [L, E] per micro-batch, this rank, with gradient

    def _world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.group)
        return 1

    def _sum_over_ranks(self, counts: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._world_size() == 1:
            return counts, num_tokens
        buffer = torch.cat([counts.reshape(-1), num_tokens.reshape(1)])  # one collective for both
        dist.all_reduce(buffer, group=self.group)
        return buffer[:-1].view_as(counts), buffer[-1]

    def __call__(self, router_logits: tuple[torch.Tensor, ...], token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Record one micro-batch; return its loss term (0 when `deferred`)."""
        stats = router_statistics(router_logits, self.top_k, token_mask)
        counts, num_tokens = self._sum_over_ranks(stats.counts, stats.num_tokens)
        self.counts = counts if self.counts is None else self.counts + counts
        self.num_tokens = num_tokens if self.num_tokens is None else self.num_tokens + num_tokens
        self._local_prob_sums.append(stats.prob_sums)
        if self.deferred:
            return stats.prob_sums.new_zeros(())
        # f from the step so far; P of this micro-batch over all ranks, as this rank's share (see class doc).
        f_counts = self.counts * (num_tokens / self.num_tokens)  # rescaled so pooling divides by this micro-batch
        share = stats.prob_sums * self._world_size()
        return pooled_load_balancing_loss(f_counts, share, num_tokens)

    def loss(self) -> torch.Tensor:
        """The exact load-balancing loss of everything recorded since `reset()`, as this rank's share."""
        if self.counts is None:
            raise RuntimeError("GlobalLoadBalancer.loss() called before any micro-batch was recorded")
        share = torch.stack(self._local_prob_sums).sum(0) * self._world_size()
        return pooled_load_balancing_loss(self.counts, share, self.num_tokens)
