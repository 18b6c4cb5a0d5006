"""Configuration of the MoE gated-attention causal LM (the paper's 15B-A2.5B setting).

The dense config plus transformers' Qwen3-MoE fields under their names, so a
Qwen3-MoE `config.json` maps onto it key for key (`num_local_experts`, which
transformers 5 writes for Qwen3-MoE, is accepted for `num_experts`), and two
additions: an optional shared expert with its own sigmoid gate (Qwen2-MoE's
`shared_expert_intermediate_size`; 0, the default, means none, so a Qwen3-MoE
state dict loads strictly), `router_z_loss_coef` (ST-MoE's z-loss) and
`router_scores_fp32` (Mixtral's numerics: the top-k weights stay in fp32
instead of being cast to the model dtype before the expert mix).
"""

from __future__ import annotations

from ..compat import MOE_EXPERT_PARALLEL_PLAN
from .gated_attention import GatedAttentionConfig


class GatedAttentionMoeConfig(GatedAttentionConfig):
    r"""Decoder-only LM with gated softmax attention and sparse MoE MLPs.

    Layer `i` is sparse when `i not in mlp_only_layers`, `num_experts > 0` and
    `(i + 1) % decoder_sparse_step == 0` (Qwen3-MoE's rule); other layers use a
    dense MLP of width `intermediate_size`. Each token goes to
    `num_experts_per_tok` of `num_experts` experts of width
    `moe_intermediate_size`, weighted by their softmax router probabilities
    (renormalised over the chosen ones when `norm_topk_prob`).

    With `output_router_logits` the model returns the router logits, the
    load-balancing loss (`aux_loss`) and the z-loss (`z_loss`); when labels are
    given too, `router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss`
    is added to the loss. See `gated_attention.modeling.load_balancing` for the
    global-batch load balancing.

    ```python
    >>> from gated_attention import GatedAttentionMoeConfig
    >>> GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b").num_experts
    128
    ```
    """

    model_type = "gated_attention_moe"
    attribute_map = {"num_local_experts": "num_experts"}
    base_model_ep_plan = MOE_EXPERT_PARALLEL_PLAN  # Qwen3-MoE's, in the installed release's API

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = 0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    router_scores_fp32: bool = False

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def __post_init__(self, **kwargs):
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        super().__post_init__(**kwargs)
