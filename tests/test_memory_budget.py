"""`hub.memory_budget`: the budget every command runs a large model within, on hand-counted sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gated_attention.hub.command_line import physical_memory
from gated_attention.hub.memory_budget import MemoryBudget, MemoryBudgetError, largest_layer

# A Llama whose largest block is a decoder layer, and one whose largest is the embedding.
WIDE_LAYERS = dict(vocab_size=10, hidden_size=16, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2)  # fmt: skip
BIG_VOCAB = {**WIDE_LAYERS, "vocab_size": 1000}


def meta_llama(dtype: torch.dtype = torch.bfloat16, **config) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**config)).to(dtype)


def test_the_largest_layer_is_counted_as_accelerate_places_it():
    # One decoder layer: q and o 16x16, k and v 16x8 (2 kv heads of 4), gate/up/down 16x64 each, two norms of 16.
    layer = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 64 + 2 * 16
    assert largest_layer(meta_llama(**WIDE_LAYERS)) == ("model.layers.0", 2 * layer)  # bf16: 2 bytes each
    assert largest_layer(meta_llama(torch.float32, **WIDE_LAYERS)) == ("model.layers.0", 4 * layer)
    assert largest_layer(meta_llama(**BIG_VOCAB)) == ("model.embed_tokens", 2 * 1000 * 16)  # lm_head the same, second


def test_a_budget_smaller_than_the_largest_layer_is_refused_in_one_line():
    model = meta_llama(**WIDE_LAYERS)
    MemoryBudget(7744, True).check_holds(model, "unused")  # exactly one layer (counted above): enough
    with pytest.raises(MemoryBudgetError) as given:
        MemoryBudget(7000, True).check_holds(model, "give more")
    assert str(given.value) == "--max-memory 7.00 KB is too small for one layer: model.layers.0 needs 7.74 KB in bfloat16; give more"
    with pytest.raises(MemoryBudgetError, match=r"^only 10 B of memory is free, too small for one layer"):
        MemoryBudget(10, False).check_holds(model, "free some")


def test_without_a_size_the_budget_is_what_is_free():
    budget = MemoryBudget.resolve(None)
    assert not budget.given and 0 < budget.size <= physical_memory()
    assert "free memory" in budget.describe()
    assert MemoryBudget.resolve(123) == MemoryBudget(123, True)
    assert MemoryBudget(123, True).max_memory() == {"cpu": 123}  # accelerate adds the disk for the rest


def test_the_offload_folder_is_removed_also_after_an_error(tmp_path):
    budget = MemoryBudget(2**20, True)
    with budget.placement(dir=tmp_path) as kwargs:
        folder = Path(kwargs["offload_folder"])
        assert folder.is_dir() and folder.parent == tmp_path
        assert kwargs["device_map"] == "auto" and kwargs["max_memory"] == {"cpu": 2**20}
    assert not folder.exists()
    with pytest.raises(RuntimeError), budget.placement(dir=tmp_path) as kwargs:
        (Path(kwargs["offload_folder"]) / "weight.dat").write_bytes(b"x")
        raise RuntimeError("a failed load")
    assert list(tmp_path.iterdir()) == []
