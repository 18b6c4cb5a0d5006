"""The weight rules and the family records as data: what `plan_weights` makes of a checkpoint, without a model.

The families' own conversions (every rule on real checkpoints, verified bit for bit) are in test_convert.py;
these cases are the rules' contract for a record that is not one of ours: any module path, any order.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gated_attention.convert.convert import conversion_gate_spec
from gated_attention.convert.families import detect_family
from gated_attention.convert.plan import GATE_BIAS_INIT, AddGate, Rename, Split, key_mapping, plan_weights
from gated_attention.convert.source_config import load_source_config
from gated_attention.convert.sources import ConversionError, SourceCheckpoint
from gated_attention.convert.targets import target_config
from gated_attention.convert.writer import write_sharded

# A GPT-2-shaped block: no `self_attn.o_proj`, the gate goes before `attn.c_proj`.
SOURCE = {
    "transformer.h.0.attn.c_attn.weight": (8, 24),
    "transformer.h.0.attn.c_proj.weight": (8, 8),
    "transformer.h.0.mlp.c_fc.weight": (8, 16),
}
GATE_SHAPES = {"transformer.h.0.attn.attn_gate.weight": (8, 8), "transformer.h.0.attn.attn_gate.bias": (8,)}
GPT2_GATE = AddGate("attn.c_proj.weight", "attn.attn_gate")


class Target:
    """The target's config as `plan_weights` reads it: any transformers config has these two."""

    model_type = "gpt2"
    tie_word_embeddings = True


def _checkpoint(folder, names_and_shapes, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    folder.mkdir()
    save_file({n: torch.randn(s, generator=g).to(dtype) for n, s in names_and_shapes.items()}, folder / "model.safetensors")
    return SourceCheckpoint(folder)


def _written(tmp_path, outputs):
    """The planned tensors as the writer writes them, read back."""
    from safetensors.torch import load_file

    (tmp_path / "dst").mkdir()
    write_sharded(tmp_path / "dst", outputs)
    return load_file(tmp_path / "dst" / "model.safetensors")


@pytest.mark.parametrize("init", ["exact", "bias"])
def test_the_gate_rule_works_on_any_module_path(tmp_path, init):
    """`AddGate` with another model's paths: the projection doubled (exact) or kept, the gate made beside it."""
    ckpt = _checkpoint(tmp_path / "src", SOURCE)
    outputs = plan_weights(ckpt, {**SOURCE, **GATE_SHAPES}, Target(), init=init, dtype=None, rules=(GPT2_GATE,))
    assert [o.name for o in outputs] == [*list(SOURCE)[:2], *GATE_SHAPES, list(SOURCE)[2]]  # the gate after c_proj
    written = _written(tmp_path, outputs)
    source = {n: ckpt.read(n) for n in SOURCE}
    proj = source["transformer.h.0.attn.c_proj.weight"]
    assert torch.equal(written["transformer.h.0.attn.c_proj.weight"], proj * 2 if init == "exact" else proj)
    assert torch.equal(written["transformer.h.0.attn.c_attn.weight"], source["transformer.h.0.attn.c_attn.weight"])
    gate_weight, gate_bias = (written[n] for n in GATE_SHAPES)
    assert gate_weight.dtype == gate_bias.dtype == torch.bfloat16 and not gate_weight.any()
    assert torch.equal(gate_bias, torch.full((8,), GATE_BIAS_INIT if init == "bias" else 0.0, dtype=torch.bfloat16))
    # Kept as they are, the others are copied byte for byte (`copy_of`); the doubled one is made.
    copied = {o.name for o in outputs if o.copy_of is not None}
    assert ("transformer.h.0.attn.c_proj.weight" in copied) == (init == "bias")


def test_a_gate_the_source_has_already_is_not_made_again(tmp_path):
    ckpt = _checkpoint(tmp_path / "src", {**SOURCE, **GATE_SHAPES})
    outputs = plan_weights(ckpt, {**SOURCE, **GATE_SHAPES}, Target(), init="exact", dtype=None, rules=(GPT2_GATE,))
    assert all(o.copy_of is not None for o in outputs if "attn_gate" in o.name)  # SRC's own, copied


def test_rules_apply_in_the_records_order(tmp_path):
    """A rename, then a split of the renamed tensor, then the gate on a split part."""
    ckpt = _checkpoint(tmp_path / "src", {"blocks.0.qkvo.weight": (16, 4)})
    rules = (
        Rename(r"^blocks\.", "layers."),
        Split("qkvo.weight", ("q.weight", "o.weight")),
        AddGate("o.weight", "gate"),
    )
    expected = {"layers.0.q.weight": (12, 4), "layers.0.o.weight": (4, 4), "layers.0.gate.weight": (4, 4)}
    outputs = plan_weights(ckpt, expected, Target(), init="exact", dtype=torch.float32, rules=rules)
    written = _written(tmp_path, outputs)
    source = ckpt.read("blocks.0.qkvo.weight").float()
    assert torch.equal(written["layers.0.q.weight"], source[:12])
    assert torch.equal(written["layers.0.o.weight"], source[12:] * 2)
    assert not written["layers.0.gate.weight"].any()
    # transformers can rename while loading, not cut: the split has no key mapping; the gate adds nothing to it
    assert key_mapping((rules[0], rules[2]), None, 1) == {r"^blocks\.": "layers."}
    with pytest.raises(ValueError, match="Split changes tensors"):
        key_mapping(rules, None, 1)


def test_two_source_tensors_that_would_become_one_are_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "src", {"a.weight": (2, 2), "b.weight": (2, 2)})
    with pytest.raises(ConversionError, match="^SRC tensors a.weight and b.weight would both be c.weight$"):
        plan_weights(ckpt, {"c.weight": (2, 2)}, Target(), init="copy", dtype=None, rules=(Rename(r"^[ab]\.", "c."),))


def test_the_fla_hybrid_is_a_record_with_its_reader_and_refusals(tmp_path):
    """The fla family reads config.json with its own reader and refuses what the hybrid lacks in one line, as
    every record does (`Family.reader`, `Family.unsupported`)."""
    raw = {"model_type": "gated_deltanet", "allow_neg_eigval": True, "attn": {"layers": [1], "num_heads": 4}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    family = detect_family(raw)
    source = load_source_config(tmp_path, family)
    assert type(source) is family.reader and source.raw["hidden_size"] == family.defaults["hidden_size"]
    with pytest.raises(ConversionError, match=r"^SRC's fla Gated DeltaNet hybrid config is not supported: allow_neg_eigval"):
        target_config(source, family, conversion_gate_spec("elementwise", "exact"))
