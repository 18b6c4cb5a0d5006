"""transformers' classes that predate `_can_record_outputs`, gated by declaration from the record `analyze` reads
them with (`recorded_outputs.LEGACY_DECLARATIONS`): Falcon in its old (parallel attention and MLP, multi-query) and
new (grouped key/value heads, two layer norms) decoder architectures, Bloom (ALiBi, the residual added inside its
attention), GPT-Neo (a local-attention layer), MPT and OpenAI-GPT (Conv1D projections).

Each tiny random source is converted by `gated-attention convert`, whose verification asks for the same bits after
every layer; DST loaded through the package gives SRC's logits exactly, random gates move them (the gate is live),
and the gate sites the analysis reads are the gates convert wrote.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gated_attention  # noqa: F401 - registers the declared types
from gated_attention.cli import main
from gated_attention.modeling.gate_sites import gate_sites

SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)  # the config's attribute_map
# test id -> (model type, its own fields)
SOURCES = {
    "falcon": ("falcon", dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True)),
    "falcon-new-decoder": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2)),
    "bloom": ("bloom", {}),
    "gpt_neo": ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=64)),
    "mpt": ("mpt", {}),
    "openai-gpt": ("openai-gpt", dict(n_positions=64)),
}
PROMPT = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))  # 9 > GPT-Neo's window of 4


@pytest.mark.parametrize("name", SOURCES)
def test_a_legacy_class_converts_exactly_with_live_gates(name, tmp_path, capsys):
    model_type, fields = SOURCES[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES, **fields)).save_pretrained(tmp_path / "src")
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "bit-identical after every layer and in the logits" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(model).__name__ == "Gated" + type(source).__name__
    gates = {n: p for n, p in model.named_parameters() if ".attn_gate." in n}
    assert len(gates) == SIZES["num_hidden_layers"]
    assert len(gate_sites(model)) == SIZES["num_hidden_layers"]  # what `analyze` reads the scores from
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, source(PROMPT).logits)
        for p in gates.values():
            p.normal_()
        assert not torch.allclose(model(PROMPT).logits, source(PROMPT).logits, atol=1e-3)  # the gate is live
