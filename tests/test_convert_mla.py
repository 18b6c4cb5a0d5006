"""Latent attention (MLA: DeepSeek-V2/V3, MiniCPM3, Kimi, ...) gated by declaration with a headwise gate.

Absorbed inference (vLLM's MLA kernels) never expands the latent into values: it folds each head's value
up-projection into the output projection and attends over the latent `c` itself,

    y = sum_h (W_O^h W_UV^h) sum_j a_hj c_j,

so a gate must commute with `W_O^h W_UV^h`. A per-head score does (`g_h` moves through the product), an elementwise
gate, which would sit between the two matrices, does not: `convert` takes `--gate headwise` on MLA and refuses the
elementwise gate in one line. The tests convert tiny random sources exactly, show the gate live, build the absorbed
form of the gated DeepSeek-V3 by hand and compare it with transformers' own (unabsorbed) forward, and read the gate's
scores with `analyze`.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gated_attention  # noqa: F401 - registers the declared types
from gated_attention.cli import main

from convert_helpers import file_hashes, staging_leftovers

MLA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
           kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, vocab_size=64,
           max_position_embeddings=64)  # fmt: skip  # v_head_dim differs from every other width: a wrong head split fails
SOURCES = {
    "deepseek_v3": dict(MLA, q_lora_rank=8, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                        n_group=1, topk_group=1, first_k_dense_replace=1),  # layer 2 is MoE
    "deepseek_v2": dict(MLA, q_lora_rank=None, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                        first_k_dense_replace=1),  # no query latent: q_proj
    "minicpm3": dict(MLA, q_lora_rank=8),
}
PROMPT = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))


def save_source(model_type: str, folder, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SOURCES[model_type], **overrides}))
    model.save_pretrained(folder)
    return type(model).from_pretrained(folder).eval()


@pytest.mark.parametrize("model_type", SOURCES)
def test_headwise_gate_converts_exactly_and_is_live(model_type, tmp_path, capsys):
    source = save_source(model_type, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--gate", "headwise"]) == 0
    assert "bit-identical after every layer and in the logits" in capsys.readouterr().out
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["attn_gate"]["granularity"] == "headwise" and config["source_model_type"] == model_type
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    gates = {n: p for n, p in model.named_parameters() if ".attn_gate." in n}
    # one score per head: [H, hidden]
    assert [tuple(p.shape) for p in gates.values()] == [(MLA["num_attention_heads"], MLA["hidden_size"])] * 2
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, source(PROMPT).logits)
        for p in gates.values():
            p.normal_()
        assert not torch.allclose(model(PROMPT).logits, source(PROMPT).logits, atol=1e-3)  # the gate is live


@pytest.mark.parametrize("flags", [[], ["--gate", "elementwise"]])
def test_an_elementwise_gate_on_latent_attention_is_refused_in_one_line(flags, tmp_path, capsys):
    save_source("deepseek_v3", tmp_path / "src", num_hidden_layers=1)
    before = file_hashes(tmp_path / "src")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "DeepseekV3Attention is latent attention" in err and "absorbed inference" in err and "use --gate headwise" in err
    assert not (tmp_path / "dst").exists() and staging_leftovers(tmp_path / "dst") == []
    assert file_hashes(tmp_path / "src") == before


def absorbed_attention(attention, x: torch.Tensor, position_embeddings) -> torch.Tensor:
    """A gated DeepSeek-V3 attention in absorbed form, by hand: queries taken into the latent through each head's key
    up-projection, attention over the latent `c` (never expanded into keys and values), each head's output
    projection folded with its value up-projection, and the gate's per-head scores multiplied in last.
    `x`: `[B, T, hidden]` -> `[B, T, hidden]` (the causal mask of a prompt without padding)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    B, T, _ = x.shape
    H, nope, rope, v = attention.num_heads, attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim
    r = attention.kv_lora_rank
    q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(x))).view(B, T, H, nope + rope).transpose(1, 2)
    q_nope, q_rot = q.split([nope, rope], dim=-1)  # [B, H, T, nope], [B, H, T, rope]
    c, k_rot = attention.kv_a_proj_with_mqa(x).split([r, rope], dim=-1)
    c = attention.kv_a_layernorm(c)  # [B, T, r]: the latent, all a cache holds besides k_rot
    k_rot = k_rot.view(B, 1, T, rope)
    rotate = ds.apply_rotary_pos_emb_interleave if attention.config.rope_interleave else ds.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings)
    w_kv = attention.kv_b_proj.weight.view(H, nope + v, r)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, r], [H, v, r]
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the query absorbs the key up-projection
    scores = (torch.einsum("bhtr,bsr->bhts", q_latent, c) + q_rot @ k_rot.transpose(-1, -2)) * attention.scaling
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    a = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, T, S]
    o_latent = torch.einsum("bhts,bsr->bhtr", a, c)  # [B, H, T, r]: attention over the latent itself
    w_o = attention.o_proj.weight.view(-1, H, v)  # [hidden, H, v]
    w_ouv = torch.einsum("ohv,hvr->hor", w_o, w_uv)  # [H, hidden, r]: W_O^h W_UV^h, folded once
    g = torch.sigmoid(attention.attn_gate(x)).transpose(1, 2)  # [B, H, T]: one score per head
    return torch.einsum("bht,hor,bhtr->bto", g, w_ouv, o_latent)  # o_proj has no bias here


def test_the_gated_model_in_absorbed_form_equals_transformers_forward(tmp_path):
    """The property that lets absorbed engines serve the gated model: per head, the gate's score moves through
    `W_O^h W_UV^h`. In float64 with SDPA (eager attention takes its softmax in float32) the two forms differ only by
    the order of their sums (~1e-16 relative), so the tolerance is 1e-10: a gate put between `W_UV` and `W_O`, or a
    wrong head split, is off by O(0.1)."""
    save_source("deepseek_v3", tmp_path / "src", first_k_dense_replace=2)  # dense layers: experts run no float64
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--gate", "headwise"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", attn_implementation="sdpa", dtype=torch.float64)
    model.eval()
    seen = []
    for layer in model.model.layers:
        attention = layer.self_attn
        with torch.no_grad():
            attention.attn_gate.weight.normal_()  # a gate far from its exact init: scores vary per head and token
        attention.register_forward_hook(lambda m, args, kwargs, out: seen.append((m, args, kwargs, out[0])),
                                        with_kwargs=True)  # fmt: skip
    with torch.no_grad():
        model(PROMPT)
        assert len(seen) == MLA["num_hidden_layers"]
        for attention, args, kwargs, out in seen:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            absorbed = absorbed_attention(attention, x, kwargs["position_embeddings"])
            torch.testing.assert_close(absorbed, out, rtol=1e-10, atol=1e-10)


def test_analyze_reads_the_headwise_gates_scores(tmp_path):
    """`analyze` finds each latent attention's gate (`gate_sites`) and reports its scores: exactly 0.5 at the exact
    init, one per head."""
    import csv

    from gated_attention.training import data

    tokenizer = data.load_tokenizer(300, max_chars=150_000)
    save_source("minicpm3", tmp_path / "src", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--gate", "headwise"]) == 0
    assert main(["analyze", str(tmp_path / "dst"), "--out", str(tmp_path / "out"), "--max-length", "24",
                 "--bootstrap", "10", "--n-per-domain", "1"]) == 0  # fmt: skip
    with open(tmp_path / "out" / "gates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["layer"]) for r in rows}) == [1, 2]
    assert all(float(r["mean"]) == 0.5 for r in rows), rows[:2]
