"""`memory.budget`: the budget every command runs a large model within, on hand-counted sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gated_attention.cli_common import physical_memory
from gated_attention.memory.budget import MemoryBudget, MemoryBudgetError, largest_layer

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


def test_a_budget_smaller_than_the_largest_layer_is_refused_in_one_line(weights_only_budget):
    model = meta_llama(**WIDE_LAYERS)
    MemoryBudget(7744, True).check_holds(model, "unused")  # exactly one layer (counted above): enough
    with pytest.raises(MemoryBudgetError) as given:
        MemoryBudget(7000, True).check_holds(model, "give more")
    assert str(given.value) == "--max-memory 7.00 KB is too small for one layer: model.layers.0 needs 7.74 KB in bfloat16; give more"
    with pytest.raises(MemoryBudgetError, match=r"^only 10 B of memory is free, too small for one layer"):
        MemoryBudget(10, False).check_holds(model, "free some")


def test_what_the_process_holds_and_what_running_takes_come_off_the_budget(monkeypatch):
    """`--max-memory` bounds the process: the weights get what is left after the memory the process holds
    before the model loads, the caller's reserve for running it and the runtime's slack; accelerate then keeps
    one layer of that free."""
    from gated_attention.memory import budget as memory_budget

    monkeypatch.setattr(memory_budget, "process_memory", lambda: 500_000)
    monkeypatch.setattr(memory_budget, "RUNTIME_SLACK", 10_000)
    model = meta_llama(**WIDE_LAYERS)  # largest layer 7,744 bytes
    budget = MemoryBudget(600_000, True)
    assert budget.running_reserve(30_000) == 40_000
    assert budget.weights_room(reserve=30_000) == 60_000
    assert budget.accelerate_max_memory(reserve=30_000) == {"cpu": 60_000}
    assert budget.accelerate_max_memory(reserve=30_000, scale=0.5) == {"cpu": 30_000}  # loaded at half the width it runs in
    budget.check_holds(model, "unused", reserve=600_000 - 500_000 - 10_000 - 7744)  # exactly enough
    with pytest.raises(MemoryBudgetError) as e:
        budget.check_holds(model, "give more", reserve=600_000 - 500_000 - 10_000 - 7743)
    assert str(e.value) == ("--max-memory 600.00 KB is too small for one layer: model.layers.0 needs 7.74 KB in bfloat16, "
                            "running the model 92.26 KB more and this process holds 500.00 KB already (Python, torch "
                            "and the libraries); give more")
    # free memory, measured beside the process: only the caller's reserve comes off
    assert MemoryBudget(600_000, False).weights_room(reserve=40_000) == 560_000
    assert budget.accelerate_max_memory(reserve=10**9) == {"cpu": 1}  # nothing left: every layer read from disk
    # Loaded in bf16 and cast to fp32 once loaded: until the cast ends, the layers in memory are held twice
    # (1.5x their fp32 size); accelerate's one fp32 layer of 10,000 bytes comes beside them. 100,000 bytes of room:
    # 100,000 / 1.5 + 10,000 in fp32 bytes, half that in the bf16 bytes accelerate counts.
    budget = MemoryBudget(610_000, True)  # 100,000 bytes of room
    assert budget.accelerate_max_memory(scale=0.5, cast_largest=10_000) == {"cpu": int((100_000 / 1.5 + 10_000) * 0.5)}
    # Loaded in fp32 and narrowed to bf16: the layers in memory are held three times their bf16 size until the cast
    # ends, and accelerate counts fp32 bytes, twice the bf16 ones. bf16 to fp16 (the same width) holds both too.
    assert budget.accelerate_max_memory(scale=2.0, cast_largest=10_000) == {"cpu": int((100_000 / 3 + 10_000) * 2)}
    assert budget.accelerate_max_memory(scale=1.0, cast_largest=10_000) == {"cpu": 100_000 // 2 + 10_000}


def test_reading_a_weight_stored_in_another_dtype_reserves_its_stored_bytes():
    from gated_attention.memory.budget import reading_reserve

    model = meta_llama(torch.float32, **BIG_VOCAB)  # the embedding, 1000 x 16, is the largest tensor
    assert reading_reserve(model, "bfloat16") == 2 * 1000 * 16  # mapped from the file beside its fp32 cast
    assert reading_reserve(model, torch.float16) == 2 * 1000 * 16
    assert reading_reserve(model, "float32") == 0  # the mapped bytes are the weight
    assert reading_reserve(model, None) == reading_reserve(model, "int8") == 0  # unknown, or not a float


def test_without_a_size_the_budget_is_what_is_free():
    budget = MemoryBudget.resolve(None)
    assert not budget.given and 0 < budget.limit <= physical_memory()
    assert "free memory" in budget.describe()
    assert MemoryBudget.resolve(123) == MemoryBudget(123, True)
    assert MemoryBudget(123, False).accelerate_max_memory() == {"cpu": 123}  # accelerate adds the disk for the rest


def test_the_offload_folder_is_removed_also_after_an_error(tmp_path, weights_only_budget):
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


def test_the_split_is_said_once_a_budget_and_only_for_max_memory(monkeypatch):
    from gated_attention.memory import budget as memory_budget

    monkeypatch.setattr(memory_budget, "process_memory", lambda: 500_000)
    monkeypatch.setattr(memory_budget, "RUNTIME_SLACK", 10_000)
    said = []
    budget = MemoryBudget(600_000, True)
    budget.say_split(30_000, said.append)
    budget.say_split(10, said.append)  # a later load of the same run (convert's DST)
    assert said == ["--max-memory 600.00 KB: 500.00 KB this process, 40.00 KB running reserve, 60.00 KB for weights"]
    MemoryBudget(600_000, False).say_split(40_000, said.append)  # free memory: the process's own was not taken off
    assert len(said) == 1
