"""`gated-attention export --format qwen3_5`: transformers' native Qwen3.5 gives the gated model's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM

from convert_helpers import PROMPT, TINY
from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.cli import main


def gated_model(folder, **overrides):
    """A trained-looking gated model: random gates, norms and biases, so every mapped piece matters."""
    torch.manual_seed(0)
    model = GatedAttentionForCausalLM(GatedAttentionConfig(**{**TINY, "head_dim": 16, "qk_norm": True, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # in [0.5, 2]: w - 1 is exact there
            elif "attn_gate" in name or name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model.eval()


VARIANTS = {
    "elementwise": {},
    "headwise": {"attn_gate": {"granularity": "headwise"}},
    "head-shared": {"attn_gate": {"head_shared": True}},
    "gate-bias": {"attn_gate": {"bias": True}, "attention_bias": True},
    "qwen2-bias-tied": {"qkv_bias": True, "tie_word_embeddings": True},
    "input-channels": {"attn_gate": {"input_channels": 12}},  # zero columns after the 12 the gate reads
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_qwen3_5_gives_the_gated_logits(tmp_path, variant):
    gated = gated_model(tmp_path / "gated", **VARIANTS[variant])
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 0
    assert not list((tmp_path / "native").glob("*.py"))  # no remote code
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(native) is Qwen3_5ForCausalLM
    with torch.no_grad():
        expected, got = gated(PROMPT).logits, native(PROMPT).logits
        # fp32: the same products and sums. Only a GEMM's summation order may differ (a headwise gate
        # becomes D equal rows of a wider matmul), which moves the last bits: 1e-6 of the logit scale.
        assert (expected - got).abs().max() <= 1e-6 * expected.abs().max()

        # bf16: the two layouts round in a different order (Qwen3.5's norms multiply by 1 + w in fp32
        # before rounding, Llama-style norms round first). The native model must be as close to the
        # fp32 logits as the gated model in bf16 is, within 2x.
        gated_bf16 = gated.to(torch.bfloat16)(PROMPT).logits.float()
        native_bf16 = native.to(torch.bfloat16)(PROMPT).logits.float()
        assert (native_bf16 - expected).abs().max() <= 2 * (gated_bf16 - expected).abs().max()


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"qk_norm": False}, "qk_norm=false"),
        ({"attn_gate": {"position": "G2"}}, "gate position is 'value'"),
        ({"attn_gate": {"mode": "additive", "activation": "silu"}}, "multiplicative sigmoid"),
        ({"sliding_window": 4}, "no sliding window"),
        ({"attn_gate": {"bias": True}}, "attention_bias=false"),
        ({"attn_gate": {"rank": 4}}, "this model's has rank 4, and multiplying its two factors out rounds"),
        ({"attention_sinks": True}, "Qwen3.5's attention has no learned sinks"),
    ],
    ids=["no-qk-norm", "G2", "additive-silu", "sliding-window", "gate-bias-without-attention-bias", "low-rank",
         "sinks"],
)
def test_export_refuses_what_has_no_exact_mapping(tmp_path, capsys, overrides, reason):
    gated_model(tmp_path / "gated", **overrides)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot export to qwen3_5 exactly" in err and reason in err, err
    assert not (tmp_path / "native").exists()


def test_norm_weight_without_an_exact_one_plus_w_form_is_refused(tmp_path, capsys):
    model = gated_model(tmp_path / "gated")
    with torch.no_grad():
        # 0.001 has bits down to 2^-33; w - 1 = -0.999 keeps only down to 2^-24, so 1 + (w - 1) != w in fp32.
        model.model.norm.weight[3] = 1e-3
    model.save_pretrained(tmp_path / "gated")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 2
    assert "model.norm.weight[3]" in capsys.readouterr().err
    assert not (tmp_path / "native").exists()


def test_hybrid_exports_to_native_qwen3_5(tmp_path):
    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM
    from gated_attention.convert.export import qwen3_5_torch_path

    torch.manual_seed(0)
    config = GatedDeltaNetHybridConfig(
        **{**TINY, "num_hidden_layers": 4}, head_dim=16, qk_norm=True, hybrid_ratio=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    )  # fmt: skip
    gated = GatedDeltaNetHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in gated.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "attn_gate" in name:
                p.normal_(0, 0.5)
    gated.save_pretrained(tmp_path / "gated")
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 0
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(native) is Qwen3_5ForCausalLM
    assert native.config.layer_types == config.layer_types
    with torch.no_grad(), qwen3_5_torch_path():  # transformers would route Qwen3.5's GDN to fla's GPU kernels
        expected, got = gated(PROMPT).logits, native(PROMPT).logits
    # fp32; the two sides run different (chunked) delta-rule code, so the last bits may differ: 1e-5 of the scale.
    assert (expected - got).abs().max() <= 1e-5 * expected.abs().max()


def test_hybrid_without_output_gate_is_refused(tmp_path, capsys):
    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM

    config = GatedDeltaNetHybridConfig(
        **{**TINY, "num_hidden_layers": 2}, head_dim=16, qk_norm=True, hybrid_ratio=2, linear_output_gate=False,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    GatedDeltaNetHybridForCausalLM(config).save_pretrained(tmp_path / "gated")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 2
    assert "linear_output_gate=false" in capsys.readouterr().err
    assert not (tmp_path / "native").exists()


# --- the mlx layout: the Hub's Qwen3.5 config (model_type qwen3_5, text_config), for mlx-lm ----------------


def _hybrid(folder, **schedule):
    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM

    torch.manual_seed(0)
    config = GatedDeltaNetHybridConfig(
        **{**TINY, "num_hidden_layers": 4}, head_dim=16, qk_norm=True, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, **schedule,
    )  # fmt: skip
    model = GatedDeltaNetHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "attn_gate" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["hybrid", "dense-tied"])
def test_mlx_layout_is_the_same_model_for_transformers(tmp_path, capsys, kind):
    import json

    from gated_attention.convert.export import qwen3_5_torch_path

    if kind == "hybrid":
        _hybrid(tmp_path / "gated", hybrid_ratio=2)  # LALA: mlx-lm's full_attention_interval 2
    else:  # all attention (mlx-lm will not run it: warned) and tied embeddings, read from text_config
        gated_model(tmp_path / "gated", tie_word_embeddings=True)
    gated = str(tmp_path / "gated")
    assert main(["export", gated, str(tmp_path / "text"), "--format", "qwen3_5"]) == 0
    capsys.readouterr()
    assert main(["export", gated, str(tmp_path / "mlx"), "--format", "qwen3_5", "--layout", "mlx"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "mlx-lm will not run" in line]
    assert len(warned) == (kind != "hybrid"), warned

    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["text_config"]["model_type"] == "qwen3_5_text"
    assert config["text_config"].get("full_attention_interval") == (2 if kind == "hybrid" else None)
    assert config["tie_word_embeddings"] == config["text_config"]["tie_word_embeddings"] == (kind != "hybrid")

    text = AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    mlx = AutoModelForCausalLM.from_pretrained(tmp_path / "mlx").eval()
    assert type(mlx) is Qwen3_5ForCausalLM and mlx.config.layer_types == text.config.layer_types
    with torch.no_grad(), qwen3_5_torch_path():
        # The same class, weights and values: the same computation, so the same bits.
        assert torch.equal(text(PROMPT).logits, mlx(PROMPT).logits)


def test_full_attention_interval_is_the_one_mlx_lm_would_place(tmp_path):
    from gated_attention.configuration.gated_deltanet_hybrid import hybrid_layer_types
    from gated_attention.convert.export_layouts import full_attention_interval, llama_cpp_limit, mlx_lm_limit

    L, A = "linear_attention", "full_attention"
    assert full_attention_interval(hybrid_layer_types(4, 2)) == 2
    assert full_attention_interval(hybrid_layer_types(6, 4)) == 4  # LLLALL: the trailing block is placed too
    assert full_attention_interval(hybrid_layer_types(3, 3)) == 3
    for schedule in ([A, A, A], [L, L], [L, A, L, L], [L, A, A, L], [A, L, A, L]):
        assert full_attention_interval(schedule) is None, schedule
    assert mlx_lm_limit([L, A], 4) is None
    assert "all attention" in mlx_lm_limit([A, A], 4) and "all Gated DeltaNet" in mlx_lm_limit([L, L], 4)
    assert "(LALL, A = attention) has no such interval" in mlx_lm_limit([L, A, L, L], 4)
    assert "width 1" in mlx_lm_limit([L, A], 1)
    # llama.cpp's converter before its PR #28208: full_attention_interval alone, 4 where there is none
    assert llama_cpp_limit(hybrid_layer_types(8, 4), None) is None  # LLLALLLA: what 4 places
    assert llama_cpp_limit(hybrid_layer_types(6, 3), 3) is None  # the mlx layout writes the interval
    assert "(LLALLA, A = attention) as LLLALL" in llama_cpp_limit(hybrid_layer_types(6, 3), None)
    assert "it is 2" in llama_cpp_limit([L, A, L, L], 2)  # an interval that is not this schedule's


def test_export_warns_in_one_line_where_mlx_lm_cannot_run_and_still_writes(tmp_path, capsys):
    _hybrid(tmp_path / "gated", layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5"]) == 0
    mlx, llama_cpp = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert mlx.startswith("gated-attention export: warning: mlx-lm will not run this export: ") and "LALL" in mlx
    assert llama_cpp.startswith("gated-attention export: warning: llama.cpp's GGUF converter before its PR #28208 "
                                "reads only full_attention_interval") and "(LALL, A = attention) as LLLA" in llama_cpp
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "native").config.layer_types[:2] == ["linear_attention", "full_attention"]


def _byte_level_bpe(folder):
    """A GPT-2-style byte-level BPE (GPT-2's regex, no normalizer), as the package's quickstart trains."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = ["def f(x):\n    return x ** 2\n", "Don't panic: 1234 apples, 56 pears.", "caf\u00e9 and cafe\u0301"] * 20
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=TINY["vocab_size"] - 1, special_tokens=["<|eos|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>").save_pretrained(folder)


@pytest.mark.parametrize("layout", ["text", "mlx"])
def test_mlx_layout_says_when_qwen3_5_tokenizer_would_tokenize_differently(tmp_path, capsys, layout):
    _hybrid(tmp_path / "gated", hybrid_ratio=2)
    _byte_level_bpe(tmp_path / "gated")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "native"), "--format", "qwen3_5", "--layout", layout]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "pre-tokenizer" in line]
    # Only the mlx layout's model_type (qwen3_5) makes transformers >= 5.18 swap in Qwen3_5Tokenizer.
    assert len(warned) == (layout == "mlx"), warned
    assert not warned or "PreTrainedTokenizerFast.from_pretrained(DST)" in warned[0]
