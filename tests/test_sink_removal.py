"""The sink removal of `quickstart --preset trained --remove-sink`: `analysis.interventions.mask_first_token`.

What it claims: in the masked layers no query q >= 1 gives weight to key 0, and the other keys share what it had
(the softmax renormalised over them); nothing before the first masked layer changes, nor the first token itself in
it (query 0 keeps its only key); the layers not masked keep their attention to the first token. Checked on a tiny
random model against its own unmasked pass, in eager attention (whose maps `Capture` reads) and sdpa (the recipes'
training path), with and without a cache.
"""

from __future__ import annotations

import pytest
import torch

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.analysis.capture import Capture
from gated_attention.analysis.interventions import first_token_mask, mask_first_token

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
MASKED = [3, 5]  # 1-based; layers 1, 2 and 4 keep their attention to the first token


def build(attn: str = "eager", gate=None, **config) -> torch.nn.Module:
    model = GatedAttentionForCausalLM(GatedAttentionConfig(**TINY, attn_gate=gate, **config))
    model.set_attn_implementation(attn)
    return model.eval()


def count_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.fixture
def ids():
    return torch.randint(3, TINY["vocab_size"], (2, 11))


def _capture(model, ids):
    with Capture(model, residual=True, attentions=True, gates=False) as cap:
        logits = model(input_ids=ids, use_cache=False).logits
    record = cap.records[-1]
    return logits, record.residual, record.attentions


@pytest.mark.parametrize("gate", [None, {"position": "G1"}], ids=["ungated", "G1"])
@torch.no_grad()
def test_the_masked_layers_give_the_first_token_nothing_and_the_rest_is_untouched(gate, ids):
    model = build(gate=gate)
    logits, residual, maps = _capture(model, ids)
    with mask_first_token(model, MASKED):
        logits_m, residual_m, maps_m = _capture(model, ids)
    assert count_hooks(model) == 0  # removed on exit

    for l in range(MASKED[0]):  # X[0..2]: everything before the first masked layer, bit for bit
        assert torch.equal(residual_m[l], residual[l])
    # the first masked layer: token 0's output is its own (it attends to itself alone, as before) ...
    assert torch.equal(residual_m[MASKED[0]][:, 0], residual[MASKED[0]][:, 0])
    # ... and every later token's changes (it lost the first token's share)
    assert (residual_m[MASKED[0]][:, 1:] - residual[MASKED[0]][:, 1:]).abs().amax(dim=-1).min() > 0
    assert not torch.allclose(logits_m, logits)

    for l in MASKED:
        w, w_m = maps[l], maps_m[l]  # [B, H, T, T]
        assert torch.all(w_m[:, :, 1:, 0] == 0) and torch.all(w_m[:, :, 0, 0] == 1)
        assert torch.all(w[:, :, 1:, 0] > 0)  # there was something to remove
        if l == MASKED[0]:  # same input as the unmasked pass: the other keys' weights renormalised, nothing else
            rest = w[:, :, 1:, 1:]
            torch.testing.assert_close(w_m[:, :, 1:, 1:], rest / rest.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert torch.all(maps_m[4][:, :, 1:, 0] > 0)  # a layer left alone keeps its attention to the first token


@torch.no_grad()
def test_eager_and_sdpa_mask_alike_with_and_without_a_cache(ids):
    """sdpa gets no mask of its own here (its causal flag): the hook's causal mask must equal eager's; decoding with
    a cache, each new query sits at its absolute position, so the last token's logits equal the whole pass's."""
    eager, sdpa = build("eager"), build("sdpa")
    sdpa.load_state_dict(eager.state_dict())
    with mask_first_token(eager, MASKED), mask_first_token(sdpa, MASKED):
        a = eager(input_ids=ids, use_cache=False).logits
        b = sdpa(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # two float32 attention kernels, ~1e-7 apart
        prefix = sdpa(input_ids=ids[:, :-1], use_cache=True)
        step = sdpa(input_ids=ids[:, -1:], cache=prefix.past_key_values, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], b[:, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sdpa(input_ids=ids, use_cache=False).logits, b)  # the mask was on


def test_the_mask_on_hand_made_masks():
    """Key 0 blocked for queries at absolute positions >= 1, whatever form the attention's own mask takes."""
    causal = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert torch.equal(first_token_mask(None, 3, 3, torch.device("cpu")), expected)
    assert torch.equal(first_token_mask(causal[None, None], 3, 3, torch.device("cpu")), expected[None, None])
    additive = torch.zeros(1, 1, 3, 3).masked_fill(~causal, torch.finfo(torch.float32).min)
    got = first_token_mask(additive, 3, 3, torch.device("cpu"))
    assert torch.equal(got == 0, expected[None, None]) and torch.all(got[~expected[None, None]] == torch.finfo(torch.float32).min)
    # two new queries after three cached keys: positions 3 and 4, both blocked from key 0
    assert torch.equal(first_token_mask(None, 2, 5, torch.device("cpu")),
                       torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool))
    # the first token decoding alone keeps itself
    assert torch.equal(first_token_mask(None, 1, 1, torch.device("cpu")), torch.tensor([[True]]))


def test_a_layer_without_attention_is_refused():
    with pytest.raises(ValueError, match=r"layers \[6\] have no softmax attention"):
        with mask_first_token(build(), [2, 6]):
            pass


def test_training_under_the_mask_gives_the_first_token_no_gradient(ids):
    """With every layer masked, token 0 reaches no other token: its embedding gets gradient only from predicting
    token 1 (the loss at position 0), so with that target left out it gets none (the embeddings untied, so that
    the output layer's gradient does not reach it either)."""
    model = build("sdpa", tie_word_embeddings=False).train()
    ids = ids.clone()
    ids[:, 0] = 0  # an id that occurs nowhere else (`ids` draws from 3 up)
    with mask_first_token(model, range(1, TINY["num_hidden_layers"] + 1)):
        logits = model(input_ids=ids, use_cache=False).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits[:, 1:-1].reshape(-1, TINY["vocab_size"]), ids[:, 2:].reshape(-1))
        loss.backward()
    grad = model.model.embed_tokens.weight.grad  # [V, D]
    assert torch.all(grad[0] == 0) and grad[ids[:, 1:].unique()].abs().sum() > 0
