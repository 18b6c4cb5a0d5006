"""Dense causal LM with gated softmax attention.

Layout and parameter names are Llama's; `GatedAttentionForCausalLM` with the
gate off is a Llama/Mistral/Qwen2/Qwen3 model and loads their state dicts with
`strict=True`.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..compat import accepts_cache_kwarg, mask_kwargs, with_cache
from ..configuration.gated_attention import GatedAttentionConfig
from .attention import GatedAttention
from .base import GatedForCausalLM, GatedPreTrainedModel
from .packing import packed_sequences

logger = logging.get_logger(__name__)


class GatedAttentionDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `h = x + mix(norm(x)); out = h + mlp(norm(h))`, the gated attention as its mixer.

    Families change the parts, never the block: `add_mixer` / `mix` (the hybrid's
    Gated DeltaNet) and `make_mlp` (the MoE family's sparse block).
    """

    def __init__(self, config: GatedAttentionConfig, layer_idx: int):
        super().__init__()
        self.add_mixer(config, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def add_mixer(self, config: GatedAttentionConfig, layer_idx: int) -> None:
        self.self_attn = GatedAttention(config, layer_idx)

    def make_mlp(self, config: GatedAttentionConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    def mix(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        cache: Cache | None,
        **kwargs,
    ) -> torch.Tensor:
        """The mixer on the normed input: `[B, T, hidden]` -> `[B, T, hidden]`."""
        out, _ = self.self_attn(
            x, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache, **kwargs
        )
        return out

    @accepts_cache_kwarg
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        mixed = self.mix(self.input_layernorm(hidden_states), attention_mask, position_embeddings, cache, **kwargs)
        h = hidden_states + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class GatedAttentionPreTrainedModel(GatedPreTrainedModel):
    config: GatedAttentionConfig
    config_class = GatedAttentionConfig
    _no_split_modules = ["GatedAttentionDecoderLayer"]
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": GatedAttentionDecoderLayer,
        "attentions": GatedAttention,
    }


class GatedAttentionModel(GatedAttentionPreTrainedModel):
    # Families that change only the layer (e.g. the MoE model) or the output type set these.
    decoder_layer_class: type[nn.Module] = GatedAttentionDecoderLayer
    output_class: type[BaseModelOutputWithPast] = BaseModelOutputWithPast
    # Layer type -> the mask its layers get; families with other layer types (the GDN hybrid) extend it.
    mask_functions = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    # Layer types whose mixer is a recurrence: no mask separates the sequences of a packed row there, so their
    # layers get the sequences' bounds as `sequence_bounds` (see packing.py). Attention has none.
    recurrent_layer_types: frozenset[str] = frozenset()

    def __init__(self, config: GatedAttentionConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def has_recurrent_layers(self) -> bool:
        return not self.recurrent_layer_types.isdisjoint(self.config.layer_types)

    @property
    def attention_free(self) -> bool:
        """Recurrent layers and no full attention (the massive-activations paper's pure Gated DeltaNet, rho = infinity)."""
        return self.has_recurrent_layers and "full_attention" not in self.config.layer_types

    @accepts_cache_kwarg
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.has_recurrent_layers and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            raise ValueError(
                "a custom 4-D attention mask cannot be applied to Gated DeltaNet layers (a recurrence sees every "
                "earlier token of its row); pass a 2-D padding mask, or pack sequences with position_ids"
            )
        if position_ids is None and self.attention_free and kwargs.get("cu_seq_lens_q") is None:
            # Nothing reads positions, and the cache has no attention layer to count past tokens (its
            # get_seq_length raises). The input's device, not the embedding's: accelerate leaves an offloaded
            # weight on "meta".
            tokens = input_ids if input_ids is not None else inputs_embeds
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None]
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids, sequence_bounds = packed_sequences(
            position_ids,
            attention_mask,
            kwargs.get("cu_seq_lens_q"),
            *inputs_embeds.shape[:2],
            masks_separate=not (use_cache or cache is not None or self.has_recurrent_layers),
        )
        if sequence_bounds is not None:  # several sequences in one row: none of them can continue from a cache
            if cache is not None:
                raise ValueError("packed rows (several sequences in one row) cannot fill or continue a cache; pass none")
            if use_cache:
                if not torch.compiler.is_compiling():  # logging would break the graph
                    logger.warning_once("Packed rows (several sequences in one row) run without a cache: use_cache=False.")
                use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # generate() may hand over masks it already built (`layer_masks` too), one per layer type.
        if not isinstance(mask_by_type := attention_mask, dict):
            mask_by_type = self.layer_masks(inputs_embeds, attention_mask, position_ids, cache)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            bounds = {"sequence_bounds": sequence_bounds} if layer_type in self.recurrent_layer_types else {}
            hidden_states = layer(
                hidden_states,
                attention_mask=mask_by_type[layer_type],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **bounds,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return with_cache(self.output_class, cache if use_cache else None, last_hidden_state=hidden_states)

    def layer_masks(self, inputs_embeds, attention_mask, position_ids, cache) -> dict:
        """One mask per layer type, each sized by the cache of the first layer of that type.

        Left to guess, transformers 5.17 sizes the full-attention mask by the first layer that is not
        sliding: with a linear-attention layer first, by the sliding layer after it (transformers PR #48510).
        """
        kwargs = mask_kwargs(
            cache, config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids
        )
        first_of_type = {kind: self.config.layer_types.index(kind) for kind in dict.fromkeys(self.config.layer_types)}
        return {kind: self.mask_functions[kind](**kwargs, layer_idx=i) for kind, i in first_of_type.items()}


class GatedAttentionForCausalLM(GatedAttentionPreTrainedModel, GatedForCausalLM, GenerationMixin):
    model_class = GatedAttentionModel
