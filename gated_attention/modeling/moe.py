"""Sparse MoE block (the router losses and global-batch load balancing are in `load_balancing.py`).

The block is transformers' Qwen3-MoE block, reused as it is, so parameter
names and numerics are Qwen3-MoE's: the router `mlp.gate.weight` `[E, hidden]`
and the fused experts `mlp.experts.gate_up_proj` `[E, 2 * I, hidden]` and
`mlp.experts.down_proj` `[E, hidden, I]`, which dispatch on
`config._experts_implementation` ("eager", "grouped_mm", ...). Optionally a
shared expert is added, as in Qwen2-MoE: `mlp.shared_expert` (a SwiGLU MLP)
scaled by `sigmoid(mlp.shared_expert_gate(x))`.

Routing: `p = softmax(x W_r^T)` in fp32; each token goes to its top-k experts,
weighted by p (renormalised over the k chosen when `norm_topk_prob`). Qwen3-MoE
casts those weights to the model dtype before mixing; Mixtral keeps them in
fp32 (`config.router_scores_fp32`), which rounds differently in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter


class Fp32ScoresTopKRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's router with Mixtral's numerics: top-k weights returned in fp32."""

    def forward(self, hidden_states: torch.Tensor):  # [N, hidden] -> logits [N, E], scores/indices [N, k]
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
        scores, indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return router_logits, scores, indices


class SparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE's block (`gate`: router, `experts`: fused experts) plus an optional gated shared expert."""

    def __init__(self, config):
        super().__init__(config)
        if config.router_scores_fp32:
            self.gate = Fp32ScoresTopKRouter(config)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = Qwen3MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] -> [B, T, hidden]
        out = super().forward(hidden_states)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return out
