"""`hub.loading.from_pretrained_checked`: a checkpoint whose config.json and weights disagree is refused in one
line naming the first tensor, where transformers prints a MISSING / UNEXPECTED table and loads random or
truncated layers; a checkpoint whose weights fit loads as `from_pretrained` loads it.

Tiny random models, saved and edited here: a config that says 3 layers over weights of 2 (a random layer),
1 over 2 (a truncated model), and another intermediate size (tensors of another shape).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import gated_attention
from gated_attention.hub.loading import WeightsMismatch, from_pretrained_checked


class _Recorder(logging.Handler):
    def __init__(self, records: list):
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record):
        self.records.append(record)


def _save(folder: Path, model) -> Path:
    model.save_pretrained(folder)
    return folder


def _edit_config(folder: Path, **fields) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    if "num_hidden_layers" in fields:
        config.pop("layer_types", None)  # one per layer: rebuilt from the new count
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> Path:
    config = gated_attention.GatedAttentionConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2)
    return _save(tmp_path_factory.mktemp("gated"), gated_attention.GatedAttentionForCausalLM(config))


@pytest.mark.parametrize("tie", [False, True])
def test_weights_that_fit_load_as_from_pretrained_loads_them(tmp_path, tie):
    """transformers' own Llama, tied embeddings included (lm_head.weight is not saved then, and not missing)."""
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, tie_word_embeddings=tie)
    folder = _save(tmp_path / "llama", LlamaForCausalLM(config))
    model = from_pretrained_checked(AutoModelForCausalLM, folder)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


CASES = {  # config fields written over the 2-layer checkpoint's: the start of the one line
    "config says 3 layers": ({"num_hidden_layers": 3},
                             "its weights lack tensor model.layers.2.input_layernorm.weight (and 9 more), which its "
                             "config implies"),
    "config says 1 layer": ({"num_hidden_layers": 1},
                            "its weights hold tensor model.layers.1.input_layernorm.weight (and 9 more), which a "
                            "gated_attention model with its config does not have"),
    "other intermediate size": ({"intermediate_size": 48},
                                "its tensor model.layers.0.mlp.down_proj.weight (and 5 more) has shape [16, 32], and "
                                "its config implies [16, 48]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_that_do_not_fit_their_config_are_one_line(gated, tmp_path, case, monkeypatch):
    fields, expected = CASES[case]
    folder = tmp_path / "edited"
    folder.mkdir()
    for f in gated.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _edit_config(folder, **fields)
    warnings = []  # what transformers' loading logs: its MISSING / UNEXPECTED table is a warning
    logger = logging.getLogger("transformers.modeling_utils")
    monkeypatch.setattr(logger, "level", logging.WARNING)
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, _Recorder(warnings)])
    with pytest.raises(WeightsMismatch) as error:
        from_pretrained_checked(AutoModelForCausalLM, folder)
    message = str(error.value)
    assert message.startswith(expected) and message.endswith("config.json and the weights disagree"), message
    assert "\n" not in message
    assert not [r for r in warnings if "LOAD REPORT" in r.getMessage()]  # not printed beside the one line
