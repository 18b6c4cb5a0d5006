"""The dense gated-attention LM against transformers' models and hand-written references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM, GatedAttentionModel
from gated_attention.compat import cache_of

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_config(**overrides) -> GatedAttentionConfig:
    return GatedAttentionConfig(**{**TINY, **overrides})


def tiny_model(**overrides) -> GatedAttentionForCausalLM:
    return GatedAttentionForCausalLM(tiny_config(**overrides)).eval()


# --- gate off: the transformers model with the same weights --------------------------------------

SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}, {"sliding_window": 5}),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"tie_word_embeddings": True},
        {"qkv_bias": True, "tie_word_embeddings": True},
    ),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}, {"qk_norm": True, "head_dim": 32}),
}


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(SOURCES))
def test_gate_off_matches_transformers(family, attn_implementation):
    config_cls, model_cls, src_extra, our_extra = SOURCES[family]
    source = model_cls(config_cls(**TINY, **src_extra, attn_implementation=attn_implementation)).eval()
    rope = {"rope_parameters": dict(source.config.rope_parameters)}
    ours = GatedAttentionForCausalLM(
        tiny_config(attn_gate=None, attn_implementation=attn_implementation, **rope, **our_extra)
    ).eval()
    ours.load_state_dict(source.state_dict(), strict=True)

    ids = torch.randint(0, TINY["vocab_size"], (2, 12))  # 12 > sliding_window: the window is exercised
    with torch.no_grad():
        expected, got = source(ids).logits, ours(ids).logits
    # Same ops in the same order; 1e-5 leaves room for kernel choice between two module instances.
    assert (expected - got).abs().max().item() <= 1e-5


# --- gated variants: a hand-written reference -------------------------------------------------------


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x: [B, H, T, D]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv_freq[None]  # [T, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_attention(attn, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Gated attention written out from the paper's equations, without transformers' helpers."""
    config = attn.config
    spec = config.attn_gate
    B, T, _ = x.shape
    HQ, HKV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    act = {
        "sigmoid": torch.sigmoid,
        "silu": F.silu,
        "ns_sigmoid": lambda s: 0.5 + 0.5 * torch.sigmoid(s),
    }[spec["activation"]]

    def gate(position, y, heads):
        if spec["position"] != position:
            return y
        g, x_in = attn.attn_gate, x[..., : spec["input_channels"] or x.shape[-1]]
        if not spec["input_dependent"]:
            logits = g.logits.expand(B, T, -1)
        elif spec["rank"]:
            logits = x_in @ g.down.weight.T @ g.up.weight.T + (g.up.bias if g.up.bias is not None else 0)
        else:
            logits = x_in @ g.weight.T + (g.bias if g.bias is not None else 0)
        if position == "dense":
            scores = act(logits)
        else:
            width = D if spec["granularity"] == "elementwise" else 1
            scores = act(logits).view(B, T, 1 if spec["head_shared"] else heads, width)
        return y * scores if spec["mode"] == "multiplicative" else y + scores

    q = (x @ attn.q_proj.weight.T).view(B, T, HQ, D)
    k = (x @ attn.k_proj.weight.T).view(B, T, HKV, D)
    v = (x @ attn.v_proj.weight.T).view(B, T, HKV, D)
    q, k, v = gate("query", q, HQ), gate("key", k, HKV), gate("value", v, HKV)
    pos = torch.arange(T)
    q, k = _rope(q.transpose(1, 2), pos, theta), _rope(k.transpose(1, 2), pos, theta)
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    if config.attention_sinks:  # one more logit per head in the denominator, with no value
        sinks = attn.sinks.view(1, HQ, 1, 1).expand(B, HQ, T, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    y = (probs @ v).transpose(1, 2)  # [B, T, HQ, D]
    if config.attn_output_norm == "rmsnorm":
        y = _rms(y, attn.attn_output_norm.weight, config.rms_norm_eps)
    if config.attn_output_activation == "silu":
        y = F.silu(y)
    y = gate("sdpa", y, HQ)
    return gate("dense", y.reshape(B, T, HQ * D) @ attn.o_proj.weight.T, None)


H, HKV, D, HID = TINY["num_attention_heads"], TINY["num_key_value_heads"], 16, TINY["hidden_size"]

# name -> (config overrides, extra parameters per layer as the paper's construction implies)
VARIANTS = {
    "baseline": ({"attn_gate": None}, 0),
    "G1-elementwise": ({"attn_gate": {"position": "G1"}}, HID * H * D),
    "G1-headwise": ({"attn_gate": {"position": "G1", "granularity": "headwise"}}, HID * H),
    "G1-elementwise-shared": ({"attn_gate": {"head_shared": True}}, HID * D),
    "G1-headwise-shared": ({"attn_gate": {"granularity": "headwise", "head_shared": True}}, HID),
    "G1-bias": ({"attn_gate": {"bias": True}}, HID * H * D + H * D),
    "G1-additive-silu": ({"attn_gate": {"mode": "additive", "activation": "silu"}}, HID * H * D),
    "G1-ns-sigmoid": ({"attn_gate": {"activation": "ns_sigmoid"}}, HID * H * D),
    "G1-input-independent": ({"attn_gate": {"input_dependent": False}}, H * D),
    "G2-elementwise": ({"attn_gate": {"position": "G2"}}, HID * HKV * D),
    "G2-headwise": ({"attn_gate": {"position": "value", "granularity": "headwise"}}, HID * HKV),
    "G3-elementwise": ({"attn_gate": {"position": "G3"}}, HID * HKV * D),
    "G4-elementwise": ({"attn_gate": {"position": "G4"}}, HID * H * D),
    "G5-elementwise": ({"attn_gate": {"position": "G5"}}, HID * HID),
    "G5-input-independent": ({"attn_gate": {"position": "G5", "input_dependent": False}}, HID),
    "sdpa-rmsnorm": ({"attn_gate": None, "attn_output_norm": "rmsnorm"}, D),
    "sdpa-silu": ({"attn_gate": None, "attn_output_activation": "silu"}, 0),
    # Issue 60's gates: low-rank, truncated input, both, and GPT-OSS's learned sink with and without the gate.
    "G1-low-rank": ({"attn_gate": {"rank": 4}}, HID * 4 + 4 * H * D),
    "G1-input-channels": ({"attn_gate": {"input_channels": 12}}, 12 * H * D),
    "G1-headwise-low-rank-input-channels": (
        {"attn_gate": {"granularity": "headwise", "rank": 2, "input_channels": 16, "bias": True}}, 16 * 2 + 2 * H + H
    ),
    "G1-shared-low-rank": ({"attn_gate": {"head_shared": True, "rank": 4}}, HID * 4 + 4 * D),
    "G2-low-rank": ({"attn_gate": {"position": "G2", "rank": 4}}, HID * 4 + 4 * HKV * D),
    "sinks": ({"attn_gate": None, "attention_sinks": True}, H),
    "G1-sinks": ({"attn_gate": {"position": "G1"}, "attention_sinks": True}, HID * H * D + H),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_reference_and_adds_the_papers_parameters(name):
    overrides, extra_per_layer = VARIANTS[name]
    model = tiny_model(**overrides, attn_implementation="eager")
    baseline = tiny_model(attn_gate=None)
    extra = model.num_parameters() - baseline.num_parameters()
    assert extra == extra_per_layer * TINY["num_hidden_layers"]

    attn = model.model.layers[0].self_attn
    if "attn_gate" in dict(attn.named_children()) and not model.config.attn_gate["input_dependent"]:
        torch.nn.init.normal_(attn.attn_gate.logits)  # the zero init would hide a wrong broadcast
    if model.config.attention_sinks:
        torch.nn.init.normal_(attn.sinks, std=2.0)  # near 0 a sink barely shows
    x = torch.randn(2, 9, HID)
    positions = torch.arange(9)[None]
    cos_sin = model.model.rotary_emb(x, positions)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask)
        expected = reference_attention(attn, x, model.config.rope_parameters["rope_theta"])
    # fp32, same maths in a different order (einsum vs transformers' eager path): a few ulps.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_trains(name):
    model = tiny_model(**VARIANTS[name][0]).train()
    ids = torch.randint(0, TINY["vocab_size"], (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_g1_matches_qwen3_5_gated_attention():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    theirs_config = Qwen3_5TextConfig(
        hidden_size=HID,
        num_attention_heads=H,
        num_key_value_heads=HKV,
        head_dim=D,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        attn_implementation="eager",
    )
    theirs = Qwen3_5Attention(theirs_config, layer_idx=0).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model = tiny_model(qk_norm=True, head_dim=D, attn_implementation="eager")
    ours = model.model.layers[0].self_attn
    # Qwen3.5 interleaves per head [query D | gate D] in q_proj and stores its norms as (1 + w).
    q_and_gate = theirs.q_proj.weight.view(H, 2, D, HID)
    with torch.no_grad():
        ours.q_proj.weight.copy_(q_and_gate[:, 0].reshape(H * D, HID))
        ours.attn_gate.weight.copy_(q_and_gate[:, 1].reshape(H * D, HID))
        for name in ("k_proj", "v_proj", "o_proj"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
        ours.q_norm.weight.copy_(1 + theirs.q_norm.weight)
        ours.k_norm.weight.copy_(1 + theirs.k_norm.weight)

    x = torch.randn(2, 7, HID)
    cos_sin = model.model.rotary_emb(x, torch.arange(7)[None])
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = theirs(x, position_embeddings=cos_sin, attention_mask=mask)
        got, _ = ours(x, position_embeddings=cos_sin, attention_mask=mask)
    # Qwen3.5 computes its norm as x * (1 + w) in fp32; ours multiplies by the stored 1 + w: 1e-5 covers the rounding.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_gate_is_rounded_once():
    # act(z) and the product in fp32, rounded once to bf16 (benchmarks/gate_precision.py): within half a bf16 ulp
    # of the exact product (plus fp32's own rounding). Rounding the scores to bf16 first is off by up to 1.4 ulps.
    from gated_attention.kernels.gated_sdpa.gate_activations import apply_gate

    g = torch.Generator().manual_seed(0)
    y = torch.randn(16384, generator=g).to(torch.bfloat16)
    z = (torch.randn(16384, generator=g) * 2 - 1.5).to(torch.bfloat16)
    exact = y.double() * torch.sigmoid(z.double())
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    worst = ((apply_gate(y, z, "sigmoid").double() - exact).abs() / ulp).max().item()
    assert worst <= 0.5 + 2**-15, worst


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_sinks_match_gpt_oss_attention(attn_implementation):
    """`attention_sinks` against transformers' GPT-OSS attention with the same weights (biases, sinks), a padded
    row and a causal one, outputs and the sinks' gradient. GPT-OSS runs eager (it has no SDPA path)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    theirs_config = GptOssConfig(hidden_size=HID, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D,
                                 num_hidden_layers=1, layer_types=["full_attention"], rope_parameters=rope,
                                 attention_bias=True, attn_implementation="eager")
    theirs = GptOssAttention(theirs_config, layer_idx=0)
    model = tiny_model(head_dim=D, attn_gate=None, attention_sinks=True, attention_bias=True, rope_parameters=rope,
                       attn_implementation=attn_implementation)
    ours = model.model.layers[0].self_attn
    with torch.no_grad():
        for p in theirs.parameters():
            torch.nn.init.normal_(p, std=0.3)
        theirs.sinks.mul_(10)  # logits of a few units: the sink takes a visible share of each row
        ours.load_state_dict(theirs.state_dict(), strict=True)

    x = torch.randn(2, 7, HID)
    positions = torch.arange(7)[None]
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, :3] = False  # row 0 left-padded: its real queries must not see the padding
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]  # [B, 1, T, T]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = theirs(x, position_embeddings=GptOssRotaryEmbedding(theirs_config)(x, positions),
                      attention_mask=additive)[0]
    mask = additive if attn_implementation == "eager" else allowed  # what transformers' mask builders give each
    got = ours(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask)[0]
    real = keep[:, :, None]  # padded queries' outputs are never read
    # fp32, the same softmax with its sink column written two ways: a few ulps.
    torch.testing.assert_close(got * real, expected * real, rtol=1e-5, atol=1e-5)
    (expected * real).square().sum().backward()
    (got * real).square().sum().backward()
    torch.testing.assert_close(ours.sinks.grad, theirs.sinks.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding-window"])
def test_sinks_generate_with_cache_equals_recomputation(attn_implementation, window):
    model = tiny_model(attn_gate=None, attention_sinks=True, eos_token_id=None, sliding_window=window,
                       attn_implementation=attn_implementation)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    prompt = torch.randint(3, TINY["vocab_size"], (1, 6))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        ids = prompt
        for _ in range(6):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_sinks_refuse_an_attention_that_would_drop_them():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("engine_attention", sdpa_attention_forward)  # an engine's own function: no s_aux
    model = tiny_model(attention_sinks=True)
    model.set_attn_implementation("engine_attention")
    with pytest.raises(ValueError, match=r"^attention_sinks=true cannot run with attn_implementation="
                                         r"'engine_attention', which would ignore the sinks; use 'eager', 'sdpa'"):
        model(torch.randint(0, TINY["vocab_size"], (1, 5)))


# --- generation, caching, padding ------------------------------------------------------------------


@pytest.mark.parametrize(
    "gate, window",
    [(None, None), ({"position": "G1"}, None), ({"position": "G2"}, None), ({"position": "G3"}, None),
     ({"position": "G4"}, None), ({"position": "G1"}, 4)],
    ids=["off", "G1", "G2", "G3", "G4", "G1-sliding-window"],
)
def test_greedy_generate_with_cache_equals_recomputation(gate, window):
    # eos_token_id=None: always generate all 8 tokens. The window (4) is shorter than the sequence (14).
    model = tiny_model(attn_gate=gate, eos_token_id=None, sliding_window=window)
    prompt = torch.randint(3, TINY["vocab_size"], (1, 6))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
        ids = prompt
        for _ in range(8):  # no cache: rerun the whole sequence every step
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(cached, ids)


def test_cached_logits_equal_full_forward():
    model = tiny_model()
    ids = torch.randint(3, TINY["vocab_size"], (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], use_cache=True)
        rest = model(ids[:, 6:], cache=cache_of(first), use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_prompt_alone(attn_implementation):
    model = tiny_model(pad_token_id=0, eos_token_id=None, attn_implementation=attn_implementation)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,)) for n in (7, 4)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=6, do_sample=False)
            assert torch.equal(batched[row, width:], alone[0, len(p) :])
        # The logits too, not only the argmax: position ids come from the mask.
        padded_logits = model(ids, attention_mask=mask).logits[1, width - 4 :]
        alone_logits = model(prompts[1][None]).logits[0]
    torch.testing.assert_close(padded_logits, alone_logits, rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


def test_no_split_modules_names_the_decoder_layer():
    model = tiny_model()
    layer_classes = {type(layer).__name__ for layer in model.model.layers}
    assert set(model._no_split_modules) == layer_classes


# --- registration and saving -------------------------------------------------------------------------


def test_auto_classes_are_registered():
    config = AutoConfig.for_model("gated_attention", **TINY)
    assert isinstance(config, GatedAttentionConfig)
    assert isinstance(AutoModel.from_config(config), GatedAttentionModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), GatedAttentionForCausalLM)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model(attn_gate={"position": "G2", "granularity": "headwise"}, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, GatedAttentionForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_remote_code_bundle_loads_without_the_package(tmp_path, run_without_package):
    model = tiny_model(attn_gate={"position": "G1", "granularity": "headwise"}, qk_norm=True)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    bundle = {p.name for p in folder.glob("*.py")}
    assert {"configuration_gated_attention.py", "modeling_gated_attention.py", "modeling_attention.py"} <= bundle
    for name in bundle:  # flat files: only sibling imports, which is all transformers copies
        assert "from .." not in (folder / name).read_text(), name
    ids = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    out = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        try:
            import gated_attention
            raise SystemExit("gated_attention should not be importable here")
        except ImportError:
            pass
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits = model(expected["ids"]).logits
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
        model.save_pretrained({str(tmp_path / "again")!r})  # a remote-code model saves its own files
        again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "again")!r}, trust_remote_code=True)
        with torch.no_grad():
            assert torch.equal(again(expected["ids"]).logits, expected["logits"])
        # On a CUDA machine the remote-code copy also defaults to "sdpa" (the fused kernel is opt-in), and
        # asked for, its own "gated_triton" loads (here: the torch path, hence not bit-identical).
        from unittest import mock
        with mock.patch("torch.cuda.is_available", return_value=True):
            default = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
            fused = AutoModelForCausalLM.from_pretrained(
                {str(folder)!r}, trust_remote_code=True, attn_implementation="gated_triton"
            ).eval()
        assert default.config._attn_implementation == "sdpa", default.config._attn_implementation
        assert fused.config._attn_implementation == "gated_triton", fused.config._attn_implementation
        with torch.no_grad():
            torch.testing.assert_close(fused(expected["ids"]).logits, expected["logits"], rtol=1e-5, atol=1e-5)
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
