"""Absurd configs fail fast: one line naming the field and its value, exit 2, before
any model or weight plan is built, from every command and example; nothing is silently reinterpreted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from convert_helpers import make_source
from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.cli import main
from gated_attention.configuration.validation import ConfigError, check_architecture
from example_helpers import import_example

DENSE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}

# id: (fields changed, what the one line must say)
ABSURD = {
    "a million layers": ({"num_hidden_layers": 1_000_000}, "num_hidden_layers = 1000000: expected at most 10000"),
    "no layers": ({"num_hidden_layers": 0}, "num_hidden_layers = 0: expected at least 1"),
    "head_dim 0": ({"head_dim": 0}, "head_dim = 0: expected at least 1"),
    "heads do not divide hidden": ({"hidden_size": 66}, "hidden_size = 66 is not divisible by num_attention_heads = 4"),
    "kv heads do not divide": ({"num_key_value_heads": 3}, "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    "negative vocab": ({"vocab_size": -5}, "vocab_size = -5: expected at least 1"),
    "fractional size": ({"intermediate_size": 95.5}, "intermediate_size = 95.5 is a float, expected int"),
    "no positions": ({"max_position_embeddings": 0}, "max_position_embeddings = 0: expected at least 1"),
    "layer_types too short": ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers = 2"),
    "more experts per token than experts": ({"num_local_experts": 4, "num_experts_per_tok": 8},
                                            "num_experts_per_tok = 8 is more than the 4 experts"),
}


@pytest.mark.parametrize("case", list(ABSURD))
def test_check_architecture_names_the_field_and_value(case):
    changes, expected = ABSURD[case]
    with pytest.raises(ConfigError) as info:
        check_architecture({**DENSE, **changes}, "config.json")
    assert str(info.value).startswith("config.json: ") and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_check_architecture_accepts_real_configs():
    check_architecture(DENSE)
    check_architecture({**DENSE, "hidden_size": 66, "head_dim": 16})  # an explicit head size need not divide
    check_architecture(GatedAttentionConfig(**DENSE))  # a config object: its to_dict()
    check_architecture({**DENSE, "num_key_value_heads": None, "head_dim": None})  # None: derived by the class


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_source("llama", tmp_path_factory.mktemp("llama") / "src")


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gated") / "src"
    config = GatedAttentionConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    GatedAttentionForCausalLM(config).save_pretrained(folder)
    return folder


def _absurd_copy(folder: Path, target: Path, changes: dict) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    if "hidden_size" in changes:  # a hidden size the heads must divide: no saved head_dim to say otherwise
        config.pop("head_dim", None)
    (target / "config.json").write_text(json.dumps(config))
    return target


CLI_CASES = ["a million layers", "head_dim 0", "heads do not divide hidden", "negative vocab"]


@pytest.mark.parametrize("case", CLI_CASES)
@pytest.mark.parametrize("command", ["convert", "extend", "export", "analyze"])
def test_every_command_refuses_an_absurd_config_in_one_line(llama, gated, tmp_path, capsys, command, case):
    changes, expected = ABSURD[case]
    src = _absurd_copy(llama if command == "convert" else gated, tmp_path / "src", changes)
    before = (src / "config.json").read_text()
    argv = {
        "convert": ["convert", str(src), str(tmp_path / "out"), "--no-verify"],
        "extend": ["extend", str(src), str(tmp_path / "out"), "--rope-theta", "2e4", "--no-verify"],
        "export": ["export", str(src), str(tmp_path / "out"), "--format", "qwen3_5", "--no-verify"],
        "analyze": ["analyze", str(src), "--out", str(tmp_path / "out"), "--bootstrap", "1", "--n-per-domain", "1"],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "config.json" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"] and (src / "config.json").read_text() == before


@pytest.mark.parametrize("case", CLI_CASES)
@pytest.mark.parametrize("script", ["continued_pretraining", "lora_finetune", "long_context"])
def test_every_example_refuses_an_absurd_config_in_one_line(gated, tmp_path, capsys, script, case):
    changes, expected = ABSURD[case]
    model = _absurd_copy(gated, tmp_path / "model", changes)
    extra = ["--rope-theta", "50000"] if script == "long_context" else []
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main(["--model", str(model), "--output-dir", str(tmp_path / "out"), "--steps", "1",
                               "--seq-len", "16", *extra])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: --model {model} config.json: ") and expected in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
