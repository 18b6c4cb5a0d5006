"""Hybrid causal LM: Gated DeltaNet layers interleaved with gated softmax attention, as in
"Massive Activations in Hybrid Linear Attention Large Language Models: Pre-Attention Spikes and Inter-Spike Plateaus".

Each decoder layer is the dense family's pre-norm block,
`h = x + mixer(norm(x)); out = h + mlp(norm(h))`, with `linear_attn` (a
`GatedDeltaNet`) as the mixer on "linear_attention" layers and `self_attn` (the
shared `GatedAttention`, gate and all) on attention layers, as in transformers'
Qwen3.5 / Qwen3-Next. The MLP is Llama's, or the MoE family's sparse block when
`config.num_experts > 0`; only those sparse parts (their init, the router
losses of the head) come from the MoE family. The model and masks are the
dense family's, with one more mask (linear-attention layers get the 2-D
padding mask), the router logits in its output, and the
bounds of packed sequences for the GDN layers (`recurrent_layer_types`, see
`packing.py`); a custom 4-D attention mask, which a recurrence cannot apply,
is refused. The cache is transformers' hybrid `DynamicCache(config=...)`:
key/value layers for attention, conv + recurrent states for Gated DeltaNet, or
its `StaticCache(config=..., max_cache_len=...)`
(`generate(cache_implementation="static")`), whose attention layers are
pre-allocated `StaticLayer`s beside the same fixed-size GDN states.

As in transformers' Qwen3-Next the model is stateful (`_is_stateful`): its GDN
layers hand the cache only their last recurrent state, which cannot be cropped
back to accepted tokens, so `generate` refuses assisted decoding itself, up
front: transformers' generate() leaves that to the cache, which crops a
linear-attention state correctly only when the layer hands it one state per
token; ours hands it one per call, and the crop would restore the wrong one.
"""

import copy

import torch
import transformers
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin, GenerationMode
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.modeling_outputs import MoeModelOutputWithPast

from ..compat import ATTENTION_FREE_CACHED_GENERATE
from ..configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig
from .attention import GatedAttention
from .base import returning
from .gated_attention import GatedAttentionDecoderLayer, GatedAttentionModel, GatedAttentionPreTrainedModel
from .gated_attention_moe import ROUTER_LOGITS, RouterLossesForCausalLM, SparseExpertsMixin, sparse_or_dense_mlp
from .gated_deltanet import GatedDeltaNet


class GatedDeltaNetHybridDecoderLayer(GatedAttentionDecoderLayer):
    """The dense block whose mixer is a Gated DeltaNet, `linear_attn`, on "linear_attention" layers, and whose MLP
    is sparse on the config's sparse layers (none unless `num_experts > 0`)."""

    def add_mixer(self, config: GatedDeltaNetHybridConfig, layer_idx: int) -> None:
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            super().add_mixer(config, layer_idx)

    def mix(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        cache: Cache | None,
        sequence_bounds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if self.layer_type == "linear_attention":
            return self.linear_attn(x, attention_mask=attention_mask, cache=cache, cu_seqlens=sequence_bounds)
        return super().mix(x, attention_mask, position_embeddings, cache, **kwargs)

    def make_mlp(self, config: GatedDeltaNetHybridConfig, layer_idx: int) -> nn.Module:
        return sparse_or_dense_mlp(config, layer_idx)


class GatedDeltaNetHybridPreTrainedModel(SparseExpertsMixin, GatedAttentionPreTrainedModel):
    config: GatedDeltaNetHybridConfig
    config_class = GatedDeltaNetHybridConfig
    _no_split_modules = ["GatedDeltaNetHybridDecoderLayer"]
    _is_stateful = True
    # On the CPU (the torch delta-rule path) a decode step on a static cache compiles with fullgraph=True
    # (tests/test_hybrid.py). On CUDA, fla's chunk kernel is wrapped in torch.compiler.disable (a graph break for
    # prefill and training); its decode kernel is untested under compile here (see README).
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "router_logits": ROUTER_LOGITS,
        "hidden_states": GatedDeltaNetHybridDecoderLayer,
        "attentions": GatedAttention,
    }

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GatedDeltaNet):
            A_log, dt_bias = module.initial_decay_parameters(device=module.A_log.device)
            init.copy_(module.A_log, A_log)
            init.copy_(module.dt_bias, dt_bias)


class GatedDeltaNetHybridModel(GatedDeltaNetHybridPreTrainedModel, GatedAttentionModel):
    decoder_layer_class = GatedDeltaNetHybridDecoderLayer
    output_class = MoeModelOutputWithPast  # router_logits (when num_experts > 0) are filled in by output capturing
    mask_functions = {**GatedAttentionModel.mask_functions, "linear_attention": create_recurrent_attention_mask}
    recurrent_layer_types = frozenset({"linear_attention"})

    forward = returning(GatedAttentionModel.forward, MoeModelOutputWithPast)


class GatedDeltaNetHybridForCausalLM(GatedDeltaNetHybridPreTrainedModel, RouterLossesForCausalLM, GenerationMixin):
    """The shared head with the router losses (when `num_experts > 0`), and a generate() that refuses what the
    Gated DeltaNet states cannot do."""

    model_class = GatedDeltaNetHybridModel

    def generate(self, *args, **kwargs):
        if _generation_mode(self, kwargs) == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"assisted generation is not supported with stateful models, such as {type(self).__name__}: its Gated "
                "DeltaNet states cannot be rolled back to the accepted tokens; generate without assistant_model / "
                "prompt_lookup_num_tokens"
            )
        use_cache = kwargs.get("use_cache", self.generation_config.use_cache)
        if self.model.attention_free and use_cache and not ATTENTION_FREE_CACHED_GENERATE:
            raise ValueError(
                f"generate() with a cache on a model without attention layers needs transformers>=5.24 "
                f"(installed: {transformers.__version__}); upgrade, or pass use_cache=False"
            )
        return super().generate(*args, **kwargs)


def _generation_mode(model: GenerationMixin, kwargs: dict) -> GenerationMode:
    """The mode generate() will run in, read as it reads it: its config (given or the model's) updated by the call's keywords."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config.get_generation_mode(kwargs.get("assistant_model"))
