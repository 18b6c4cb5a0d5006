"""What every model family shares with transformers' own models: class layout, packed rows, the window flag.

Packed ("padding-free") rows are what transformers' `DataCollatorWithFlattening`
builds: several sequences in one row, `position_ids` restarting at each start,
no attention mask, and with `return_flash_attn_kwargs=True` also flash-attention's
`cu_seq_lens_q/k`. The reference is each sequence run alone. The hybrid-only
behaviour (stateful generation, static cache, compiled decoding) is in
test_hybrid.py.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import DataCollatorWithFlattening, GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import TransformersKwargs

from gated_attention import (
    GatedAttentionConfig,
    GatedAttentionForCausalLM,
    GatedAttentionModel,
    GatedAttentionMoeConfig,
    GatedAttentionMoeForCausalLM,
    GatedAttentionMoeModel,
    GatedDeltaNetHybridConfig,
    GatedDeltaNetHybridForCausalLM,
    GatedDeltaNetHybridModel,
)
from gated_attention.compat import CACHE_NAME, cache_of
from gated_attention.modeling.gated_attention_moe import GatedAttentionMoeCausalLMOutput

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
FAMILIES = {
    "dense": (GatedAttentionConfig, GatedAttentionModel, GatedAttentionForCausalLM, {}),
    "moe": (
        GatedAttentionMoeConfig,
        GatedAttentionMoeModel,
        GatedAttentionMoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "hybrid": (
        GatedDeltaNetHybridConfig,
        GatedDeltaNetHybridModel,
        GatedDeltaNetHybridForCausalLM,
        dict(hybrid_ratio=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=12),
    ),
}
# Packed and one-by-one runs do the same fp32 arithmetic in differently shaped calls (SDPA with a packed mask
# against SDPA with is_causal, delta-rule chunks padded differently), which leaves ~1e-7 on logits of size ~1.
# A sequence that sees the one before it is off by ~1e-2 (0.0195 for the hybrid's GDN layers before the fix).
ATOL = 1e-5
# 70 is more than one delta-rule chunk (64), 2 is shorter than the GDN's convolution (4 taps).
LENGTHS = [5, 70, 2, 9]


def tiny_config(family: str, **overrides):
    config_cls, _, _, extra = FAMILIES[family]
    return config_cls(**{**TINY, **extra, **overrides})


def tiny_model(family: str, **overrides):
    model = FAMILIES[family][2](tiny_config(family, **overrides)).eval()
    with torch.no_grad():  # unit norms would let a mixed-up sequence hide behind symmetric weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def sequences(lengths=LENGTHS) -> list[torch.Tensor]:
    return [torch.randint(3, TINY["vocab_size"], (n,)) for n in lengths]


def one_by_one(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """`[sum(lengths), vocab]`: each sequence's logits from a forward of its own."""
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0] for s in seqs])


# --- the classes, as transformers lays its models out ------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_lists_generation_mixin_among_its_bases(family):
    assert GenerationMixin in FAMILIES[family][2].__bases__


EXPECTED_OUTPUTS = {
    GatedAttentionModel: BaseModelOutputWithPast,
    GatedAttentionForCausalLM: CausalLMOutputWithPast,
    GatedAttentionMoeModel: MoeModelOutputWithPast,
    GatedAttentionMoeForCausalLM: GatedAttentionMoeCausalLMOutput,
    GatedDeltaNetHybridModel: MoeModelOutputWithPast,
    GatedDeltaNetHybridForCausalLM: GatedAttentionMoeCausalLMOutput,
}


@pytest.mark.parametrize("model_cls", EXPECTED_OUTPUTS, ids=lambda c: c.__name__)
def test_forward_is_annotated_with_the_class_it_returns(model_cls):
    """The raw annotation, as tools read it (not a string), names the output class the forward really returns."""
    annotation = model_cls.forward.__annotations__["return"]
    assert annotation is EXPECTED_OUTPUTS[model_cls]
    family = next(name for name, (_, base, lm, _) in FAMILIES.items() if model_cls in (base, lm))
    model = model_cls(tiny_config(family)).eval()
    with torch.no_grad():
        assert type(model(torch.randint(3, TINY["vocab_size"], (1, 4)))) is annotation
    if family != "dense":
        assert "router_logits" in annotation.__dataclass_fields__


@pytest.mark.parametrize("model_cls", EXPECTED_OUTPUTS, ids=lambda c: c.__name__)
def test_forward_declares_the_keyword_arguments_transformers_passes(model_cls):
    """`**kwargs: Unpack[TransformersKwargs]`, as transformers' own models declare it: tools and transformers'
    model tests read `output_attentions` (and the packing and loss keywords) from this annotation, and the
    attention maps it asks for come back, one per softmax-attention layer, each row a distribution."""
    (kwargs_type,) = inspect.signature(model_cls.forward).parameters["kwargs"].annotation.__args__
    assert kwargs_type is TransformersKwargs
    family = next(name for name, (_, base, lm, _) in FAMILIES.items() if model_cls in (base, lm))
    config = tiny_config(family)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        attentions = model(torch.randint(3, TINY["vocab_size"], (2, 5)), output_attentions=True).attentions
    full = [t for t in getattr(config, "layer_types", ["full_attention"] * config.num_hidden_layers)
            if t == "full_attention"]
    assert len(attentions) == len(full) > 0
    for maps in attentions:
        assert maps.shape == (2, config.num_attention_heads, 5, 5)
        torch.testing.assert_close(maps.sum(-1), torch.ones(2, config.num_attention_heads, 5))


# --- packed rows --------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "cu-seq-lens"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_each_sequence_alone(family, flash_kwargs, attn_implementation):
    model = tiny_model(family, attn_implementation=attn_implementation)
    seqs = sequences()
    collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": s.tolist()} for s in seqs])  # input_ids, labels, position_ids (+ cu_seq_lens_q/k)
    with torch.no_grad():
        packed = model(**batch)  # config.use_cache is True: a packed row must still not run into a cache
    torch.testing.assert_close(packed.logits[0], one_by_one(model, seqs), atol=ATOL, rtol=0)
    assert cache_of(packed) is None  # a cache of several sequences in one row could not be continued


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_trains_as_each_sequence_alone(family):
    """The collator's labels skip each sequence's first token, so the packed loss is the token-weighted mean of
    the per-sequence losses, and its gradients theirs (fp32; relative to each gradient's largest entry)."""
    model = tiny_model(family).train()
    seqs = sequences()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in seqs])
    packed_loss = model(**batch).loss
    packed_loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    predicted = sum(len(s) - 1 for s in seqs)
    loss = sum(model(s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs) / predicted
    loss.backward()
    torch.testing.assert_close(packed_loss, loss, atol=ATOL, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5 * p.grad.abs().max().item(), rtol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_in_a_batch_equal_each_sequence_alone(family):
    """B = 2 rows of two sequences each (position_ids alone), with use_cache=False as transformers' own tests pass it."""
    model = tiny_model(family)
    rows = [sequences([6, 11]), sequences([12, 5])]
    ids = torch.stack([torch.cat(row) for row in rows])  # [2, 17]
    position_ids = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in rows])
    with torch.no_grad():
        logits = model(ids, position_ids=position_ids, use_cache=False).logits
    for b, row in enumerate(rows):
        torch.testing.assert_close(logits[b], one_by_one(model, row), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cu_seq_lens_alone_give_each_sequence_its_positions(family):
    """flash-attention's kwargs without position_ids: each sequence still starts at position 0."""
    model = tiny_model(family)
    seqs = sequences([7, 4, 9])
    cu = torch.tensor([0, 7, 11, 20], dtype=torch.int32)
    with torch.no_grad():
        logits = model(torch.cat(seqs)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
    torch.testing.assert_close(logits[0], one_by_one(model, seqs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_never_runs_silently_into_something_that_cannot_separate_it(family):
    model = tiny_model(family)
    seqs = sequences([5, 6])
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(5), torch.arange(6)])[None]
    with pytest.raises(ValueError, match="packed"):  # a given cache: the row's sequences cannot all continue it
        model(ids, position_ids=position_ids, **{CACHE_NAME: DynamicCache(config=model.config)})
    with pytest.raises(ValueError, match="attention_mask"):  # with a mask, transformers' masks ignore the restarts
        model(ids, position_ids=position_ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):  # boundaries that disagree with the positions
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        model(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batches_with_their_position_ids_are_not_mistaken_for_packed_rows(family):
    """generate()'s left padding and right padding restart positions only next to padding: no error, no change."""
    model = tiny_model(family)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # generate()'s rule
    with torch.no_grad():
        with_positions = model(ids, attention_mask=mask, position_ids=position_ids).logits
        alone = [model(ids[0:1, 3:]).logits[0], model(ids[1:2, :6]).logits[0]]
    torch.testing.assert_close(with_positions[0, 3:], alone[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(with_positions[1, :6], alone[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_in_a_fullgraph_compiled_forward(family):
    """While tracing, the positions' values are unknown: attention-only models without a cache separate packed
    rows through transformers' traced masks; where only sequence bounds could, a packed row fails in the graph.
    (backend="eager": dynamo's tracing, which is what fullgraph checks, without inductor's code generation.)"""
    model = tiny_model(family)
    seqs = sequences([5, 9])
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(5), torch.arange(9)])[None]
    forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        if family == "hybrid":
            with pytest.raises(RuntimeError, match="packed rows"):
                forward(input_ids=ids, position_ids=position_ids, use_cache=False)
        else:
            logits = forward(input_ids=ids, position_ids=position_ids, use_cache=False).logits
            torch.testing.assert_close(logits[0], one_by_one(model, seqs), atol=ATOL, rtol=0)
            with pytest.raises(RuntimeError, match="packed rows"):  # a cache in use: the masks cannot see the restarts
                forward(input_ids=ids, position_ids=position_ids, use_cache=True)
        unpacked = forward(input_ids=ids, position_ids=torch.arange(14)[None], use_cache=False).logits
        torch.testing.assert_close(unpacked, model(ids, use_cache=False).logits, atol=ATOL, rtol=0)


# --- use_sliding_window, as in Qwen2 / Qwen3 ---------------------------------------------------------


@pytest.mark.parametrize(
    "given, window, flag",
    [
        ({}, None, False),
        ({"sliding_window": 8}, 8, True),
        ({"sliding_window": 8, "use_sliding_window": True}, 8, True),
        ({"sliding_window": 8, "use_sliding_window": False}, None, False),  # Qwen2: a size kept with the flag off
    ],
    ids=["no-window", "window", "window-and-flag", "flag-off"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_use_sliding_window_agrees_with_sliding_window(family, given, window, flag):
    config = tiny_config(family, **given)
    assert (config.sliding_window, config.use_sliding_window) == (window, flag)
    if family != "hybrid":  # the hybrid's schedule has no sliding layers unless layer_types names them
        assert ("sliding_attention" in config.layer_types) is flag


@pytest.mark.parametrize("family", FAMILIES)
def test_use_sliding_window_without_a_window_is_refused(family):
    with pytest.raises(ValueError, match="use_sliding_window"):
        tiny_config(family, use_sliding_window=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_saved_before_the_flag_keep_their_window(family, tmp_path):
    tiny_config(family, sliding_window=8).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_sliding_window"] is True
    del saved["use_sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    again = FAMILIES[family][0].from_pretrained(tmp_path)
    assert (again.sliding_window, again.use_sliding_window) == (8, True)
