"""Tiny source checkpoints for the converter tests, saved as multi-shard safetensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# family -> (config class, model class, config overrides); each exercises the family's own feature.
SOURCE_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": LLAMA3_ROPE, "attention_bias": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5, "head_dim": 32}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    # MoE: transformers 5 saves both in the legacy per-expert layout (Mixtral: block_sparse_moe.experts.N.w1).
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}),
    # Phi-3: fused qkv_proj and gate_up_proj (split by the converter), a window on every layer.
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 5, "pad_token_id": 0, "eos_token_id": 2}),
}
PROMPT = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))  # 12 > window 5


def make_source(family: str, folder: Path, max_shard_size: str = "30KB", **overrides) -> Path:
    """A random tiny model of `family`; norms and biases randomised too, so a mix-up shows in the logits."""
    config_cls, model_cls, extra = SOURCE_FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def make_gated(folder: Path) -> Path:
    """A tiny gated dense model that `extend` and `export` accept (Qwen3-style q/k norm, G1 elementwise)."""
    config = GatedAttentionConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
                                  max_position_embeddings=64)  # fmt: skip
    GatedAttentionForCausalLM(config).save_pretrained(folder)
    return folder


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def staging_leftovers(dst: Path) -> list[str]:
    return [p.name for p in dst.parent.glob(f".{dst.name}.*")]


FLA_HYBRID = dict(  # fla's GatedDeltaNetConfig keys, as its save_pretrained writes them
    model_type="gated_deltanet",
    architectures=["GatedDeltaNetForCausalLM"],
    vocab_size=TINY["vocab_size"],
    hidden_size=64,
    num_hidden_layers=4,
    num_heads=2,
    num_v_heads=4,
    head_dim=16,
    expand_v=1.5,
    use_gate=True,
    use_short_conv=True,
    conv_size=4,
    hidden_ratio=4,
    intermediate_size=None,  # fla: 256 * ceil(2/3 * 4 * 64 / 256) = 256
    hidden_act="swish",
    norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    attn={"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": 5, "rope_theta": 10000.0},
    dtype="float32",
)


def make_fla_hybrid_source(folder: Path, reference: Path, max_shard_size: str = "30KB") -> Path:
    """An fla Gated DeltaNet hybrid checkpoint (fla's config.json and parameter names), and in
    `reference` the same weights as our hybrid with the gate off.

    fla's own model cannot even be built here (its attention layers need flash-attn, its norms
    Triton), so the checkpoint is written from our ungated hybrid under fla's names, spelled out
    below from fla's modeling code: embeddings, attn_norm, mlp_norm, attn.
    """
    from huggingface_hub import save_torch_state_dict

    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM

    torch.manual_seed(0)
    config = GatedDeltaNetHybridConfig(
        vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True, sliding_window=5,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "sliding_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=128, attn_gate=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = GatedDeltaNetHybridForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0, 0.5)
    model.save_pretrained(reference)
    fla_names = {
        "model.embed_tokens.": "model.embeddings.",
        ".input_layernorm.": ".attn_norm.",
        ".post_attention_layernorm.": ".mlp_norm.",
        ".self_attn.": ".attn.",
        ".linear_attn.": ".attn.",
    }
    state = {}
    for name, tensor in model.state_dict().items():
        for ours, theirs in fla_names.items():
            name = name.replace(ours, theirs)
        state[name] = tensor.contiguous()
    folder.mkdir(parents=True)
    save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
    (folder / "config.json").write_text(json.dumps(FLA_HYBRID))
    return folder


def big_source(folder: Path) -> Path:
    """A ~100 MB Llama-shaped checkpoint of zeros: big enough that writing it takes a moment."""
    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
