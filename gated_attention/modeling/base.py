"""Pieces every model family shares: the pre-trained base with remote-code saving."""

from __future__ import annotations

import os

from transformers import PreTrainedModel
from transformers.initialization import normal_, zeros_

from .attention import AttentionGate, ConstantAttentionGate
from .tensor_parallel import check_distributed_config  # importing registers the plan's own style

try:
    from gated_attention.hub.remote_code import write_remote_code
except ImportError:  # running from a remote-code copy, where transformers copies the files itself
    write_remote_code = None


class GatedPreTrainedModel(PreTrainedModel):
    """Adds the gate's init and the remote-code bundle to `save_pretrained`.

    With no `attn_implementation` asked for, every model gets transformers'
    default ("sdpa"), on CUDA too: the fused kernel ("gated_triton") is opt-in.
    On an H200 (`benchmarks/RESULTS.md`) torch's default SDPA dispatch plus a separate gate
    multiply beat the fused kernel at T >= 4096 (fwd+bwd 0.69-0.75x), so the
    fused path becomes a default only once `benchmarks/gpu_models.py` records
    a model-level training step at least as fast as "sdpa" on that device
    (the figure goes in `benchmarks/RESULTS.md`, linked from the README's "Fused gated attention").

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
        if isinstance(module, AttentionGate):
            normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                zeros_(module.bias)
        elif isinstance(module, ConstantAttentionGate):
            zeros_(module.logits)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, push_to_hub: bool = False, **kwargs):
        bundle = write_remote_code is not None and self._auto_class is None
        if bundle:
            write_remote_code(save_directory, self)  # also sets config.auto_map before config.json is written
        repo_id = kwargs.pop("repo_id", None)
        super().save_pretrained(save_directory, *args, **kwargs)
        if push_to_hub:
            from huggingface_hub import upload_folder

            upload_folder(repo_id=repo_id or os.path.basename(os.path.abspath(save_directory)), folder_path=save_directory)
