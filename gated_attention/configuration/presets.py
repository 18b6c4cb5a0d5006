"""Named model shapes from the papers, built without downloading anything.

`PRESETS[model_type][name]` holds the keyword arguments of a config; every
config class exposes its own table as a classmethod,

    from_preset = classmethod(from_preset)     # in the config class body
    GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b", num_hidden_layers=2)

where keyword arguments override the preset. A family adds its table with
`PRESETS["<model_type>"] = {...}` below (one table per model type).

The Gated Attention paper ("Gated Attention for Large Language Models: Non-linearity, Sparsity, and Attention-Sink-Free")
states only some numbers: a 1.7B dense
model; a 15B-total / 2.54B-active MoE with 128 experts, top-8 softmax routing,
GQA, global-batch load balancing and z-loss; RoPE base 10k in pretraining
(raised to 1M for the 32k extension); gating adds "fewer than 2M" parameters to
the MoE when headwise (i.e. layers x heads x hidden < 2M); and for dense models
the FFN is narrowed to keep the gated model's size equal to the baseline's.
Every other number below is taken from the Qwen3 model of that size and marked
so. `tests/test_moe.py` checks the sizes against the paper's.
"""

from __future__ import annotations

import copy
from typing import Any

QWEN3_VOCAB_SIZE = 151936  # Qwen2.5/Qwen3 tokenizer (151,646 tokens padded)
PRETRAINING_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # Gated Attention paper: base 10k before the 32k extension
PRETRAINING_CONTEXT = 4096  # not stated in the Gated Attention paper (only that the models are later extended to 32k)

# Qwen3-1.7B: 28 layers, hidden 2048, FFN 6144, 16 query / 8 key-value heads of 128, QK-norm, tied embeddings.
_QWEN3_1_7B = {
    "vocab_size": QWEN3_VOCAB_SIZE,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "qk_norm": True,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": PRETRAINING_CONTEXT,
    "rope_parameters": PRETRAINING_ROPE,
}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gated_attention": {
        # The paper's gated dense model: G1 elementwise gate (2048 x 2048 per layer, 117M in all) paid for by a
        # narrower FFN, as the paper does, so the size stays that of the baseline: 3 x 2048 x (6144 - 5472) per
        # layer = 116M (5472 = 6144 - 672, the multiple of 32 closest to the 683 that would balance exactly).
        "dense-1.7b": {**_QWEN3_1_7B, "intermediate_size": 5472, "attn_gate": {"position": "sdpa"}},
        "dense-1.7b-baseline": {**_QWEN3_1_7B, "attn_gate": None},
        # The gates the paper's is compared with (issue 60), on the baseline's shape: their few parameters (0.5M
        # and 0.26M per layer, 0.8% and 0.4% of a layer) are not paid for with a narrower FFN. Rank 128 and the
        # first 128 channels are 1/16 of the width, as marin's truncated gate; the sinks are GPT-OSS's, ungated.
        "dense-1.7b-low-rank": {**_QWEN3_1_7B, "attn_gate": {"position": "sdpa", "rank": 128}},
        "dense-1.7b-truncated": {**_QWEN3_1_7B, "attn_gate": {"position": "sdpa", "input_channels": 128}},
        "dense-1.7b-sinks": {**_QWEN3_1_7B, "attn_gate": None, "attention_sinks": True},
    },
    "gated_attention_moe": {
        # 128 experts, top-8 and the losses are the Gated Attention paper's. The rest is Qwen3-MoE: 24 layers, hidden 2048,
        # 32 query / 4 key-value heads, 768-wide experts (transformers' Qwen3MoeConfig defaults, which it calls
        # Qwen3-15B-A2B), heads of 128 and normalised top-k weights (Qwen3-30B-A3B). Headwise gating then adds
        # 24 x 32 x 2048 = 1.6M parameters, within the paper's "fewer than 2M". Sizes: 15.6B total and 2.0B active
        # without the gate (the paper says 15B / 2.54B; no Qwen3 shape gives 2.54B active at 15B total), plus
        # 0.2B for the default elementwise G1 gate. Loss coefficients are not in the seed: 1e-3 for the
        # load-balancing loss (Qwen3-MoE's default) and for the z-loss (ST-MoE's recommendation).
        "moe-15b-a2.5b": {
            "vocab_size": QWEN3_VOCAB_SIZE,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "qk_norm": True,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": PRETRAINING_CONTEXT,
            "rope_parameters": PRETRAINING_ROPE,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 1e-3,
            "router_z_loss_coef": 1e-3,
            "attn_gate": {"position": "sdpa"},
        },
    },
}


# "Massive Activations in Hybrid Linear Attention Large Language Models: Pre-Attention Spikes and Inter-Spike Plateaus".
# The paper's table of model shapes is not available here; what its text states: 24
# sequence-mixing layers at both sizes (340M and 1.3B); rho:1 means one full-attention layer per rho layers
# (rho = L / L_FA = 3, 6, 12, 24; see `gated_deltanet_hybrid.py` for the placement); models built with fla,
# trained at sequence length 4096; full attention ungated in the base models; "GDN-GatedFA" adds an elementwise
# output gate to the full-attention layers and "GDN-NoOutGate" removes the GDN output gates (appendix D.5); single
# full-attention layers at 4, 12 or 20 (1-based) for the spike experiments (D.3). The shapes are fla's standard GDN
# recipe at these sizes (fla-org/flame configs): GDN heads of 256 with 0.75 * hidden for q/k (3 heads at hidden
# 1024, 6 at 2048), value heads twice as wide (expand_v 2), short convolutions of 4, SwiGLU MLPs of
# 256 * ceil(8/3 * hidden / 256), attention heads of 64, RoPE base 10k, 32k vocabulary (Llama-2 tokenizer), untied
# embeddings. Non-embedding sizes: 342M (3:1) to 357M (24:1), and 1.37B to 1.43B; `tests/test_hybrid.py` checks
# them against the stated 340M / 1.3B within 10%.
def _gdn_shape(hidden_size: int, intermediate_size: int, attention_heads: int) -> dict[str, Any]:
    return {
        "vocab_size": 32000,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 24,
        "num_attention_heads": attention_heads,
        "num_key_value_heads": attention_heads,
        "head_dim": 64,
        "linear_num_key_heads": hidden_size * 3 // 4 // 256,
        "linear_key_head_dim": 256,
        "linear_value_head_dim": 512,
        "linear_conv_kernel_dim": 4,
        "linear_output_gate": True,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attn_gate": None,
    }


def _single_full_attention(layer: int) -> list[str]:
    return ["full_attention" if i == layer - 1 else "linear_attention" for i in range(24)]


_GDN_SIZES = {"340m": _gdn_shape(1024, 2816, 16), "1.3b": _gdn_shape(2048, 5632, 32)}
PRESETS["gated_deltanet_hybrid"] = {
    f"gdn-{size}-{rho}to1": {**shape, "hybrid_ratio": rho} for size, shape in _GDN_SIZES.items() for rho in (3, 6, 12, 24)
}
PRESETS["gated_deltanet_hybrid"].update(
    {
        "gdn-340m-3to1-gatedfa": {**_GDN_SIZES["340m"], "hybrid_ratio": 3, "attn_gate": {"position": "sdpa"}},
        "gdn-340m-3to1-nooutgate": {**_GDN_SIZES["340m"], "hybrid_ratio": 3, "linear_output_gate": False},
        **{
            f"gdn-340m-fa{layer}": {**_GDN_SIZES["340m"], "layer_types": _single_full_attention(layer)}
            for layer in (4, 12, 20)
        },
        "gdn-1.3b-fa12": {**_GDN_SIZES["1.3b"], "layer_types": _single_full_attention(12)},
    }
)

def preset_kwargs(model_type: str, name: str) -> dict[str, Any]:
    """A deep copy of the config kwargs of preset `name` for `model_type`."""
    table = PRESETS.get(model_type, {})
    if name not in table:
        available = ", ".join(sorted(table)) or "none"
        raise ValueError(f"unknown preset {name!r} for model_type {model_type!r}; available: {available}")
    return copy.deepcopy(table[name])


def from_preset(cls, name: str, **overrides):
    """Build `cls` from preset `name` of `cls.model_type`; keyword arguments override preset values.

    Meant to be bound in a config class body as `from_preset = classmethod(from_preset)`.
    """
    return cls(**{**preset_kwargs(cls.model_type, name), **overrides})
