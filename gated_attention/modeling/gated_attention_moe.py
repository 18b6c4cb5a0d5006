"""MoE causal LM with gated softmax attention (the paper's 15B-A2.5B family).

The dense model with its MLPs swapped for `moe.SparseMoeBlock` on the sparse
layers; everything else (attention and gate, norms, masks, cache) is the dense
model's. Parameter names are transformers' Qwen3-MoE, so with the gate off and
`qk_norm=True` a `Qwen3MoeForCausalLM` state dict loads with `strict=True` and
gives the same logits and `aux_loss`.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.initialization import normal_
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter
from transformers.utils.output_capturing import OutputRecorder

from ..compat import cache_of, with_cache
from ..configuration.gated_attention_moe import GatedAttentionMoeConfig
from .attention import GatedAttention
from .base import GatedForCausalLM, returning
from .gated_attention import GatedAttentionDecoderLayer, GatedAttentionModel, GatedAttentionPreTrainedModel
from .load_balancing import GlobalLoadBalancer, load_balancing_loss, router_z_loss
from .moe import SparseMoeBlock


def sparse_or_dense_mlp(config: GatedAttentionMoeConfig, layer_idx: int) -> nn.Module:
    """The MLP of a layer of a family with sparse layers: the sparse MoE block there, Llama's MLP elsewhere."""
    return SparseMoeBlock(config) if config.is_sparse_layer(layer_idx) else LlamaMLP(config)


class GatedAttentionMoeDecoderLayer(GatedAttentionDecoderLayer):
    """The dense block with a sparse MoE block as `mlp` on the config's sparse layers."""

    def make_mlp(self, config: GatedAttentionMoeConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx)


ROUTER_LOGITS = OutputRecorder(Qwen3MoeTopKRouter, index=0)  # `_can_record_outputs["router_logits"]`


class SparseExpertsMixin:
    """What a family with sparse MoE layers adds to its pre-trained base: the experts' and routers' init, and
    transformers' choice of experts implementation. Listed before the family's base among its bases."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers guesses this by looking for `@use_experts_implementation` in the model's module; our experts
        # are transformers' Qwen3MoeExperts, which carry it, so eager / grouped_mm / ... all apply.
        return True

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Qwen3MoeExperts):
            normal_(module.gate_up_proj, mean=0.0, std=std)
            normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, Qwen3MoeTopKRouter):
            normal_(module.weight, mean=0.0, std=std)


class GatedAttentionMoePreTrainedModel(SparseExpertsMixin, GatedAttentionPreTrainedModel):
    config: GatedAttentionMoeConfig
    config_class = GatedAttentionMoeConfig
    _no_split_modules = ["GatedAttentionMoeDecoderLayer"]
    _can_record_outputs = {
        "router_logits": ROUTER_LOGITS,
        "hidden_states": GatedAttentionMoeDecoderLayer,
        "attentions": GatedAttention,
    }


class GatedAttentionMoeModel(GatedAttentionMoePreTrainedModel, GatedAttentionModel):
    decoder_layer_class = GatedAttentionMoeDecoderLayer
    output_class = MoeModelOutputWithPast  # router_logits are filled in by output capturing
    forward = returning(GatedAttentionModel.forward, MoeModelOutputWithPast)


@dataclass
class GatedAttentionMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """transformers' MoE output plus the router z-loss (`aux_loss` is the load-balancing loss)."""

    z_loss: torch.Tensor | None = None


class RouterLossesForCausalLM(GatedForCausalLM):
    """The shared head, plus the router losses (load balancing, z-loss) when the model returns router logits:
    the causal-LM head of every family with sparse layers.

    Its forward takes two keywords more: `output_router_logits` (default: the config's), and `load_balancer`
    (`GlobalLoadBalancer`), which computes the load-balancing loss over the global batch instead of over this batch
    alone (see `gated_attention.modeling.load_balancing`).
    """

    head_keywords = ("output_router_logits", "load_balancer")
    forward = returning(GatedForCausalLM.forward, GatedAttentionMoeCausalLMOutput)

    def model_keywords(self, head: dict) -> dict:
        return {"output_router_logits": self._router_logits_asked(head.get("output_router_logits"))}

    def _router_logits_asked(self, output_router_logits: bool | None) -> bool:
        return self.config.output_router_logits if output_router_logits is None else output_router_logits

    def lm_output(
        self,
        outputs: MoeModelOutputWithPast,
        logits: torch.Tensor,
        loss: torch.Tensor | None,
        attention_mask,
        output_router_logits: bool | None = None,
        load_balancer: GlobalLoadBalancer | None = None,
    ) -> GatedAttentionMoeCausalLMOutput:
        aux_loss = z_loss = None
        if self._router_logits_asked(output_router_logits) and outputs.router_logits:
            token_mask = _token_mask(attention_mask, outputs.last_hidden_state.shape[1])
            if load_balancer is not None:
                aux_loss = load_balancer(outputs.router_logits, token_mask)
            else:
                aux_loss = load_balancing_loss(outputs.router_logits, self.config.num_experts_per_tok, token_mask)
            z_loss = router_z_loss(outputs.router_logits, token_mask)
            if loss is not None:
                router_loss = self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * z_loss
                loss = loss + router_loss.to(loss.device)
        return with_cache(
            GatedAttentionMoeCausalLMOutput,
            cache_of(outputs),
            loss=loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


def _token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """The `[B, T]` real-token mask of the current tokens, from a 2-D padding mask (which, with a cache, also
    covers the past); None for 4-D or absent masks, which then count every token."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask[:, -seq_len:]


class GatedAttentionMoeForCausalLM(GatedAttentionMoePreTrainedModel, RouterLossesForCausalLM, GenerationMixin):
    model_class = GatedAttentionMoeModel
