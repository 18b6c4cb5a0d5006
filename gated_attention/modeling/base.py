"""Pieces every model family shares: the pre-trained base with remote-code saving."""

from __future__ import annotations

import importlib.util
import os

import torch
from transformers import PreTrainedModel
from transformers.initialization import normal_, zeros_
from transformers.utils import logging

from ..kernels.attention_interface import GATED_TRITON
from .attention import AttentionGate, fusable_gate

logger = logging.get_logger(__name__)

try:
    from gated_attention.hub.remote_code import write_remote_code
except ImportError:  # running from a remote-code copy, where transformers copies the files itself
    write_remote_code = None


class GatedPreTrainedModel(PreTrainedModel):
    """Adds the gate's init, the fused-kernel default and the remote-code bundle to `save_pretrained`.

    With no `attn_implementation` asked for, a model whose gate the kernel can
    fuse (see `fusable_gate`) uses "gated_triton" where CUDA and triton are
    present; other models, and every model elsewhere, get transformers' default
    ("sdpa"). "gated_triton" runs the torch reference for tensors that are not on
    CUDA, so a model built on a GPU machine and run on its CPU still works.

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

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AttentionGate):
            if module.input_dependent:
                normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                if module.bias is not None:
                    zeros_(module.bias)
            else:
                zeros_(module.logits)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        fused_default = fusable_gate(self.config) and torch.cuda.is_available() and importlib.util.find_spec("triton")
        if requested_attention is None and fused_default:
            logger.info_once(f'attn_implementation defaults to "{GATED_TRITON}" on CUDA; pass "sdpa" to opt out')
            return GATED_TRITON
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, push_to_hub: bool = False, **kwargs):
        bundle = write_remote_code is not None and self._auto_class is None
        if bundle:
            write_remote_code(save_directory, self)  # also sets config.auto_map before config.json is written
        repo_id = kwargs.pop("repo_id", None)
        super().save_pretrained(save_directory, *args, **kwargs)
        if push_to_hub:
            from huggingface_hub import upload_folder

            upload_folder(repo_id=repo_id or os.path.basename(os.path.abspath(save_directory)), folder_path=save_directory)
