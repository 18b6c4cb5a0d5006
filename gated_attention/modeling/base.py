"""Pieces every model family shares: the pre-trained base with remote-code saving, and the causal-LM head.

No `from __future__ import annotations` here: tools read the forward's annotations as classes, not strings.
"""

import functools
import inspect
import os

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.initialization import normal_
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import can_return_tuple

from ..compat import CACHE_NAME, accepts_cache_kwarg, cache_of, slice_logits_to_keep, with_cache
from .attention import GATE_CLASSES, GatedAttention
from .tensor_parallel import check_distributed_config  # importing registers the plan's own style

try:
    from gated_attention.hub.remote_code import write_remote_code
except ImportError:  # running from a remote-code copy, where transformers copies the files itself
    write_remote_code = None


def returning(forward, output_class: type):
    """`forward` as a family's own, annotated with the output class it returns there (`output_class`).

    Tools read a model's output type from its forward's raw return annotation; a family whose forward is
    another's, with a richer output class, states it here instead of declaring the forward again.
    """

    @functools.wraps(forward)
    def annotated(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    annotated.__annotations__ = {**forward.__annotations__, "return": output_class}
    annotated.__signature__ = inspect.signature(forward).replace(return_annotation=output_class)
    return annotated


class GatedPreTrainedModel(PreTrainedModel):
    """Adds the gate's init and the remote-code bundle to `save_pretrained`.

    With no `attn_implementation` asked for, every model gets transformers'
    default ("sdpa"), on CUDA too: the fused kernel ("gated_triton") is opt-in.
    It becomes a default on a device only where `benchmarks/RESULTS.md` records
    a model-level training step (`benchmarks/gpu_models.py`) at least as fast
    as "sdpa" there; none does.

    Saved from the installed package, a checkpoint gets flat copies of the
    modeling files and an `auto_map`, so `from_pretrained(...,
    trust_remote_code=True)` works where `gated_attention` is not installed. A
    model that was itself loaded as remote code has `_auto_class` set, and
    transformers copies its (already flat) files.
    """

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def post_init(self):
        check_distributed_config(self.config)  # from_pretrained sets it on the config before it builds the model
        super().post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GATE_CLASSES):
            module.init_weights(self.config.initializer_range)
        elif isinstance(module, GatedAttention) and self.config.attention_sinks:
            normal_(module.sinks, mean=0.0, std=self.config.initializer_range)  # as GPT-OSS

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        # `push_to_hub=True` (with repo_id, private, token, commit_message, ...) is transformers' own push.
        bundle = write_remote_code is not None and self._auto_class is None
        self._remote_code_files = write_remote_code(save_directory, self) if bundle else []  # sets config.auto_map
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del self._remote_code_files

    def _get_files_timestamps(self, working_dir: str | os.PathLike) -> dict[str, float]:
        # transformers' push uploads the files its save_pretrained writes after listing the folder here; the
        # remote-code files were written just before, so they are left out of the list to be uploaded too.
        written = getattr(self, "_remote_code_files", ())
        return {f: t for f, t in super()._get_files_timestamps(working_dir).items() if f not in written}


class GatedForCausalLM(GatedPreTrainedModel, GenerationMixin):
    """The causal-LM head of every family: the family's model (`model_class`) as `model`, then `lm_head`.

    A family sets `model_class` and, when its outputs carry more than logits and
    a loss (the router losses of a family with sparse layers), its own `lm_output`
    (with `head_keywords` and `model_keywords` for what the call asks of it).
    """

    model_class: type[PreTrainedModel]
    # Keywords of the forward that the head reads and the model and the loss do not (the router losses')
    head_keywords: tuple[str, ...] = ()
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def create_masks_for_generate(self, inputs_embeds, attention_mask, position_ids=None, **kwargs) -> dict:
        """The masks generate() builds before a static cache's (compiled) forward: the model's own (`layer_masks`)."""
        return self.model.layer_masks(inputs_embeds, attention_mask, position_ids, kwargs.get(CACHE_NAME))

    def lm_logits_and_loss(
        self,
        outputs: BaseModelOutputWithPast,
        labels: torch.LongTensor | None,
        logits_to_keep: int | torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the kept positions `[B, T_kept, vocab]`, and the loss when labels are given."""
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return logits, loss

    @accepts_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        head = {key: kwargs.pop(key) for key in self.head_keywords if key in kwargs}
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, **self.model_keywords(head), **kwargs,
        )
        logits, loss = self.lm_logits_and_loss(outputs, labels, logits_to_keep, **kwargs)
        return self.lm_output(outputs, logits, loss, attention_mask, **head)

    def model_keywords(self, head: dict) -> dict:
        """What the model is asked for besides the call's own keywords, from the head's (`head_keywords`)."""
        return {}

    def lm_output(
        self, outputs: BaseModelOutputWithPast, logits: torch.Tensor, loss: torch.Tensor | None, attention_mask, **head
    ) -> CausalLMOutputWithPast:
        """The forward's output from the model's outputs, the logits and the loss (and the head's keywords)."""
        return with_cache(
            CausalLMOutputWithPast,
            cache_of(outputs),
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
