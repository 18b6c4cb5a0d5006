"""`SinkCache` (StreamingLLM's windowed cache) on tiny models of every family and on transformers' own.

The reference for a window that evicts is StreamingLLM written the other way round: one forward over the
whole text in which the model's rotary embedding is switched off, so queries and keys reach attention
unrotated, and an attention function (registered with transformers' `AttentionInterface`) that gives each
query t the entries a streaming cache holds for it (the sinks and the most recent tokens, itself included)
and rotates them, and the query, at their positions inside that cache, with the model's own rotary
embedding. That is "store keys before rotation", StreamingLLM's own implementation; `SinkCache` instead
re-rotates cached sink keys. The two agree to float32 rounding (2e-5 on logits of size ~1: the rotations
are composed in another order).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from transformers import (AttentionInterface, CohereConfig, CohereForCausalLM, DeepseekV3Config, DynamicCache, Gemma3ForCausalLM,
                          Gemma3TextConfig, GlmConfig, GPT2Config, GPTJConfig, GPTNeoXConfig, LlamaConfig, LlamaForCausalLM,
                          NanoChatConfig, Phi3Config, Qwen2Config, Qwen2ForCausalLM)
from transformers.models.llama import modeling_llama

from gated_attention import (
    GatedAttentionConfig,
    GatedAttentionForCausalLM,
    GatedAttentionMoeConfig,
    GatedAttentionMoeForCausalLM,
    GatedDeltaNetHybridConfig,
    GatedDeltaNetHybridForCausalLM,
    SinkCache,
)
from gated_attention.modeling.sink_cache import KeyRotation, SinkLayer

VOCAB = 97
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
ATOL = 2e-5  # float32; see the module doc


def _perturb_norms(model):
    with torch.no_grad():  # norms start at 1 and would hide a mistake that swaps or skips them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


MODELS = {
    "dense-g1": lambda: GatedAttentionForCausalLM(GatedAttentionConfig(**SHAPE)),
    "moe": lambda: GatedAttentionMoeForCausalLM(GatedAttentionMoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, attn_gate={"granularity": "headwise"})),
    "hybrid": lambda: GatedDeltaNetHybridForCausalLM(GatedDeltaNetHybridConfig(
        **{**SHAPE, "num_hidden_layers": 3}, layer_types=["full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=12)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "qwen2-yarn": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 128})),
    # interleaved pairs (channels 2i, 2i + 1), where the others rotate halves
    "cohere": lambda: CohereForCausalLM(CohereConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
}


def apply_rotary_pos_emb(q, k, cos, sin, model=None):
    """The model's own `apply_rotary_pos_emb` (this package's models use Llama's)."""
    module = importlib.import_module(type(model).__module__) if model is not None else modeling_llama
    return getattr(module, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)


def tiny(name: str):
    return _perturb_norms(MODELS[name]())


# --- the reference: keys stored before rotation, rotated at their positions in the cache ---------------------


def kept(t: int, window: int, sinks: int) -> list[int]:
    """The tokens query t attends to in a stream fed one token at a time: what the cache holds, then itself."""
    if t <= window:
        return list(range(t + 1))
    return list(range(sinks)) + list(range(t - (window - sinks), t + 1))


class _NoRotation(nn.Module):
    """The model's rotary embedding, returning the identity rotation (cos 1, sin 0) of the same shape."""

    def __init__(self, rotary):
        super().__init__()
        self.rotary = rotary

    def forward(self, x, position_ids):
        cos, sin = self.rotary(x, position_ids)
        return torch.ones_like(cos), torch.zeros_like(sin)


def streaming_reference(model, ids: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Logits `[B, T, V]` of StreamingLLM with keys stored unrotated (see the module doc)."""
    rotary = model.model.rotary_emb

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [B, HQ, T, D], key/value [B, HKV, T, D], all unrotated
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out = torch.empty_like(query)
        for t in range(query.shape[2]):
            keep = kept(t, window, sinks)
            positions = torch.arange(len(keep))[None]  # their places in the cache; the query is the last
            cos, sin = rotary(query, positions)
            q = apply_rotary_pos_emb(query[:, :, t : t + 1], query[:, :, t : t + 1], cos[:, -1:], sin[:, -1:], model)[0]
            k = apply_rotary_pos_emb(key[:, :, keep], key[:, :, keep], cos, sin, model)[0]
            weights = torch.softmax((q @ k.transpose(-1, -2)) * scaling, dim=-1)  # [B, HQ, 1, len]
            out[:, :, t : t + 1] = weights @ value[:, :, keep]
        return out.transpose(1, 2), None  # [B, T, HQ, D]

    AttentionInterface.register("sink_reference", attention)
    before = model.config._attn_implementation
    model.model.rotary_emb = _NoRotation(rotary)
    model.config._attn_implementation = "sink_reference"
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.model.rotary_emb = rotary
        model.config._attn_implementation = before


def stream(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits `[B, T, V]` of a forward loop that feeds one token at a time through `cache`."""
    logits = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


# --- tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [0, 2], ids=["window", "sinks"])
@pytest.mark.parametrize("name", list(MODELS))
def test_stream_equals_keys_stored_before_rotation(name, sinks):
    """24 tokens through an 8-entry cache: 16 evictions, each re-rotating the sinks; GDN layers keep their state."""
    model = tiny(name)
    ids = torch.randint(3, VOCAB, (2, 24))
    cache = SinkCache(window_length=8, num_sink_tokens=sinks, config=model.config)
    streamed = stream(model, ids, cache)
    torch.testing.assert_close(streamed, streaming_reference(model, ids, window=8, sinks=sinks), atol=ATOL, rtol=0)
    with torch.no_grad():  # and the window did matter: full attention gives other logits
        assert (streamed - model(ids).logits).abs().max() > 100 * ATOL


@pytest.mark.parametrize("name", list(MODELS))
def test_window_covering_the_text_equals_full_attention(name):
    """Nothing evicted, nothing rotated: generate() with left padding gives the default cache's tokens and logits, bit
    for bit, and so does a forward loop."""
    model = tiny(name)
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        full = model.generate(ids, **kwargs)
        windowed = model.generate(ids, past_key_values=SinkCache(16, 4, config=model.config), **kwargs)
    assert torch.equal(windowed.sequences, full.sequences)
    for a, b in zip(windowed.logits, full.logits):
        assert torch.equal(a, b)
    assert torch.equal(stream(model, ids, SinkCache(7, 3, config=model.config)), stream(model, ids, DynamicCache(config=model.config)))


def test_sink_entries_are_the_first_tokens_and_the_cache_is_bounded():
    """Every step holds at most `window_length` entries per layer; at the end the first `num_sink_tokens` are the
    first tokens' keys and values as the model made them (full attention's: nothing before them changed), the
    rest the latest tokens'. In layer 0 the latest tokens' keys and values too equal full attention's (its
    inputs are the embeddings, whatever the window)."""
    model = tiny("dense-g1")
    window, sinks, length = 6, 2, 30
    ids = torch.randint(3, VOCAB, (2, length))
    cache = SinkCache(window_length=window, num_sink_tokens=sinks, config=model.config)
    with torch.no_grad():
        for t in range(length):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert all(layer.keys.shape[-2] == min(t + 1, window) for layer in cache.layers)
    full = DynamicCache(config=model.config)
    stream(model, ids, full)  # one token at a time too, so that every key is computed the same way (bit for bit)
    assert cache.get_seq_length() == length
    for layer, reference in zip(cache.layers, full.layers):
        assert isinstance(layer, SinkLayer)
        assert torch.equal(layer.keys[..., :sinks, :], reference.keys[..., :sinks, :])
        assert torch.equal(layer.values[..., :sinks, :], reference.values[..., :sinks, :])
    recent = slice(length - (window - sinks), length)
    assert torch.equal(cache.layers[0].keys[..., sinks:, :], full.layers[0].keys[..., recent, :])
    assert torch.equal(cache.layers[0].values[..., sinks:, :], full.layers[0].values[..., recent, :])


@pytest.mark.parametrize("name", ["dense-g1", "hybrid"])
def test_generate_past_the_window_equals_a_forward_loop(name):
    """generate() with a batch and a window it outgrows picks the tokens (and logits) a forward loop picks."""
    model = tiny(name)
    ids = torch.randint(3, VOCAB, (2, 5))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=SinkCache(8, 2, config=model.config), max_new_tokens=15,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    looped = stream(model, out.sequences[:, :-1], SinkCache(8, 2, config=model.config))
    torch.testing.assert_close(torch.stack(out.logits, dim=1), looped[:, ids.shape[1] - 1 :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["dense-g1", "hybrid"])
def test_beam_search_past_the_window_scores_each_beam_as_a_forward_loop(name):
    """Beam search reorders the cache at every step (`reorder_cache`), sinks and GDN states included: the returned
    beams' scores are their own tokens' log-probabilities under a forward loop through the same window (a cache
    left unreordered is off by 3e-3 and more)."""
    model = tiny(name)
    ids = torch.randint(3, VOCAB, (2, 5))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=SinkCache(8, 2, config=model.config), max_new_tokens=15, num_beams=3,
                             do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                             eos_token_id=None)
        looped = stream(model, out.sequences[:, :-1], SinkCache(8, 2, config=model.config))
    new = out.sequences[:, ids.shape[1] :]
    logp = looped[:, ids.shape[1] - 1 :].log_softmax(-1).gather(-1, new[..., None])[..., 0]
    torch.testing.assert_close(out.sequences_scores, logp.sum(-1) / new.shape[1], atol=ATOL, rtol=0)


def test_a_bfloat16_window_covering_the_text_equals_full_attention():
    """In bfloat16 too, a window that evicts nothing changes no token and no logit."""
    model = tiny("dense-g1").to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=9, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        full = model.generate(ids, **kwargs)
        windowed = model.generate(ids, past_key_values=SinkCache(16, 4, config=model.config), **kwargs)
    assert torch.equal(windowed.sequences, full.sequences)
    assert all(torch.equal(a, b) for a, b in zip(windowed.logits, full.logits))


def test_several_tokens_into_a_full_cache_stay_causal():
    """After evictions, a forward of 4 tokens at once: each sees the cache and the tokens before it, not those after
    it. Its first token sees what it would see alone, so it gets the same logits."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 20))
    together, alone = SinkCache(8, 2, config=model.config), SinkCache(8, 2, config=model.config)
    stream(model, ids[:, :16], together)
    stream(model, ids[:, :16], alone)
    with torch.no_grad():
        chunk = model(ids[:, 16:], past_key_values=together, use_cache=True).logits
        first = model(ids[:, 16:17], past_key_values=alone, use_cache=True).logits
    torch.testing.assert_close(chunk[:, :1], first, atol=ATOL, rtol=0)
    assert together.get_seq_length() == 20 and together.layers[0].keys.shape[-2] == 8


def test_left_padded_row_streams_as_itself_with_fewer_sinks():
    """After evictions, a row padded by p <= num_sink_tokens tokens holds its padding in the sink entries, masked:
    it streams as the row alone would with p fewer entries and p fewer sinks (docs/streaming.md, "Padding")."""
    model = tiny("llama")
    window, sinks, pad = 8, 3, 2
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    kwargs = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, past_key_values=SinkCache(window, sinks, config=model.config), **kwargs)
        alone = model.generate(ids[:1, pad:], past_key_values=SinkCache(window - pad, sinks - pad, config=model.config), **kwargs)
    assert torch.equal(batch.sequences[0, pad:], alone.sequences[0])
    torch.testing.assert_close(torch.stack(batch.logits)[:, 0], torch.stack(alone.logits)[:, 0], atol=ATOL, rtol=0)


ROPES = {  # every RoPE layout transformers ships that a cached key can be moved in (docs/streaming.md)
    "yarn": Qwen2Config(**SHAPE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
    "linear": LlamaConfig(**SHAPE, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    "llama3": LlamaConfig(**SHAPE, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "cohere-interleaved": CohereConfig(**SHAPE),
    "glm-interleaved-partial": GlmConfig(**SHAPE),
    "nanochat-turned-the-other-way": NanoChatConfig(**SHAPE),  # its rotate_half is Llama's with the signs swapped
    "neox-partial": GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, rotary_pct=0.5),
    "gemma3-per-layer-type": Gemma3TextConfig(**SHAPE, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_key_rotation_composes_with_the_models_rope(name):
    """A key rotated at p by the model's own rotary embedding and `apply_rotary_pos_emb`, then by `steps` here, is the
    key the model rotates at p + steps (YaRN's attention factor included; Gemma 3's full-attention layers with their
    own RoPE), in float32 to its rounding."""
    config = ROPES[name]
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    rotary = next(cls for cls_name, cls in vars(module).items() if cls_name.endswith("RotaryEmbedding"))(config)
    key = torch.randn(1, 2, 3, 8)
    layer_type = "full_attention" if name.startswith("gemma3") else None

    def at(positions):
        cos, sin = rotary(key, torch.tensor([positions]), *([layer_type] if layer_type else []))
        return module.apply_rotary_pos_emb(key, key, cos, sin)[1]

    rotate = KeyRotation.from_config(config, layer_type)
    torch.testing.assert_close(rotate(at([0, 1, 2]), 1000), at([1000, 1001, 1002]), atol=1e-5, rtol=0)


def test_gemma3_streams_with_the_full_attention_layers_rope():
    """A RoPE per layer type (Gemma 3, 4B and up: linear scaling on the full-attention layers) builds and streams: the
    sink layers take the full-attention layers' frequencies, the sliding layers keep their own window."""
    model = Gemma3ForCausalLM(ROPES["gemma3-per-layer-type"]).eval()
    cache = SinkCache(8, 2, config=model.config)
    stream(model, torch.randint(3, VOCAB, (1, 12)), cache)
    sinks = [layer for layer in cache.layers if isinstance(layer, SinkLayer)]
    assert len(sinks) == 1 and sinks[0].rotation.inv_freq[0] == 1 / 8


def test_refusals_are_one_line():
    config = GatedAttentionConfig(**SHAPE)
    for window, sinks, message in [(0, 0, "window_length must be a positive int"), (4, 4, "num_sink_tokens must be"),
                                   (4, -1, "num_sink_tokens must be")]:
        with pytest.raises(ValueError, match=message):
            SinkCache(window, sinks, config=config)
    with pytest.raises(ValueError, match="no rotary position embedding"):
        SinkCache(8, 2, config=GPT2Config(n_layer=2))
    dynamic = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="changes its frequencies with the sequence length"):
        SinkCache(8, 2, config=dynamic)
    for config_refused, message in [
        (GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4), "a table of positions"),
        (Phi3Config(**SHAPE, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                              "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}),
         "changes its frequencies with the sequence length"),
        (DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "multi-head latent"),
    ]:
        with pytest.raises(ValueError, match=message):
            SinkCache(8, 2, config=config_refused)
    for window, sinks in [(True, 0), (8, True), (8.0, 2)]:  # a bool is an int to Python, and was a window of 1
        with pytest.raises(ValueError, match="must be"):
            SinkCache(window, sinks, config=config)
    gdn_only = GatedDeltaNetHybridConfig(**SHAPE, layer_types=["linear_attention"] * 2)
    with pytest.raises(ValueError, match="no full-attention layer to window"):
        SinkCache(8, 2, config=gdn_only)
    cache = SinkCache(8, 2, config=config)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
