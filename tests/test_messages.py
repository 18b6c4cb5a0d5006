"""Messages that said less, or other, than what happened."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from convert_helpers import make_source
from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.cli import main


class Payload:
    """What a malicious pickle holds: unpickling it calls a function of the file's choosing."""

    def __reduce__(self):
        return (print, ("unpickled: code ran",))


class Unknown:
    """A class weights_only does not know (and must not import)."""


@pytest.mark.parametrize("payload", [Payload, Unknown], ids=["calls-a-function", "unknown-class"])
def test_a_refused_pickle_is_one_line_of_our_own(tmp_path, capsys, payload):
    """torch's refusal is six lines ending in the advice that weights_only=False "will likely succeed"."""
    src = tmp_path / "src"
    make_source("llama", tmp_path / "base")
    src.mkdir()
    shutil.copy(tmp_path / "base" / "config.json", src)
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    torch.save({**state, "extra": payload()}, src / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "out"), "--allow-pickle", "--no-verify"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert "pytorch_model.bin was refused by torch.load(weights_only=True)" in err[0], err
    assert "weights_only=False" not in err[0] and "likely succeed" not in err[0], err
    assert payload.__name__ in err[0] or "print" in err[0], err  # what it would have loaded is named
    assert "code ran" not in captured.out + captured.err
    assert not (tmp_path / "out").exists()


def test_extends_verify_line_says_what_it_compared_with(tmp_path, capsys):
    """It printed `max |logits(SRC) - logits(DST)| = 0 (bit-identical)` for a RoPE change, against SRC
    reloaded with the new RoPE; the extended model differs from SRC itself, as it should."""
    src = tmp_path / "src"
    config = GatedAttentionConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    GatedAttentionForCausalLM(config).save_pretrained(src)
    assert main(["extend", str(src), str(tmp_path / "out"), "--rope-theta", "1e7"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("verify: "))
    assert "logits(SRC run with DST's rope_parameters)" in line and "logits(SRC)" not in line, line
    assert "differ from SRC's own" in line, line
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_theta"] == 1e7
