"""transformers' own models gated by declaration: convert, load with and without the package, generate, train.

Six families the package has no classes for, each with what makes it its own: Gemma 2 (soft-capping,
sandwich norms, sliding and full layers), Gemma 3 text (q/k norms, per-layer-type RoPE), OLMo 2 (norms
over all of q and k, after the attention), Granite (embedding, attention, residual and logit
multipliers), SmolLM3 (layers without RoPE) and Cohere (parallel attention and MLP, logit scale). Each is
converted by `gated-attention convert`, whose verification asks for the same bits after every layer; the
tests then check that the gate is there and live (random gates change the logits), that DST loads with
the package and, in a fresh interpreter without it, as remote code, that generate() with the source's
cache gives the source's tokens, and that a training step moves the gates.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

import gated_attention  # noqa: F401 - registers the declared types
from gated_attention.cli import main
from gated_attention.convert.convert import convert_checkpoint

from convert_helpers import file_hashes, staging_leftovers

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip
# model type -> (config class, model class, what the family has of its own)
FAMILIES = {
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(sliding_window=6, attn_logit_softcapping=20.0)),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM,
                    dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),
    "granite": (GraniteConfig, GraniteForCausalLM, dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                                        residual_multiplier=0.5, logits_scaling=2.0)),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0])),
    "cohere": (CohereConfig, CohereForCausalLM, dict(use_qk_norm=False, logit_scale=0.5)),
}
PROMPT = torch.randint(3, SIZES["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(0))  # 10 > window 6


def make_source(model_type: str, folder) -> torch.nn.Module:
    """A random tiny source saved in `folder`, and loaded back: compared with a loaded DST, a loaded SRC multiplies
    weights at the same kind of addresses (docs/architecture.md, "Pitfalls worth knowing": unaligned safetensors memory)."""
    config_cls, model_cls, extra = FAMILIES[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, **extra))
    with torch.no_grad():  # norms away from 1, so that a norm in the wrong place shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model_cls.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """model type -> (the source model, SRC, DST, what convert printed), converted with verification."""
    out = {}
    for model_type in FAMILIES:
        folder = tmp_path_factory.mktemp(model_type)
        source = make_source(model_type, folder / "src")
        lines = []
        result = convert_checkpoint(str(folder / "src"), folder / "dst", log=lines.append)
        assert result.max_abs_diff == 0
        out[model_type] = (source, folder / "src", folder / "dst", lines)
    return out


def gate_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".attn_gate." in name}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_converts_exactly_into_its_own_class_with_live_gates(converted, model_type):
    source, _, dst, lines = converted[model_type]
    assert "bit-identical after every layer and in the logits" in " ".join(lines)
    config = json.loads((dst / "config.json").read_text())
    assert (config["model_type"], config["source_model_type"]) == ("gated_declared", model_type)
    assert config["attn_gate"]["position"] == "sdpa" and config["auto_map"]["AutoConfig"].endswith("GatedDeclaredConfig")
    model = AutoModelForCausalLM.from_pretrained(dst).eval()  # the package route: no remote code
    assert isinstance(model, type(source)) and type(model).__name__ == "Gated" + type(source).__name__
    assert model.config.model_type == model_type  # in memory, transformers sees the source's type
    gates = gate_parameters(model)
    assert len(gates) == SIZES["num_hidden_layers"] and all(torch.all(p == 0) for p in gates.values())
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, source(PROMPT).logits)
        for p in gates.values():
            p.normal_()
        assert not torch.allclose(model(PROMPT).logits, source(PROMPT).logits, atol=1e-3)  # the gate is live


@pytest.mark.parametrize("model_type", FAMILIES)
def test_save_load_round_trip_and_a_training_step_moves_the_gates(converted, model_type, tmp_path):
    _, _, dst, _ = converted[model_type]
    model = AutoModelForCausalLM.from_pretrained(dst)
    gates = gate_parameters(model)
    before = {name: p.detach().clone() for name, p in gates.items()}
    optimizer = torch.optim.AdamW([{"params": list(gates.values()), "lr": 1e-2},
                                   {"params": [p for n, p in model.named_parameters() if n not in gates], "lr": 1e-4}])
    model.train()
    model(PROMPT, labels=PROMPT).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.values())
    optimizer.step()
    assert all(not torch.equal(p, before[name]) for name, p in gates.items())
    model.eval().save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(again(PROMPT).logits, model(PROMPT).logits)


def test_loads_as_remote_code_without_the_package(converted, tmp_path, run_without_package):
    """Every DST, in a fresh interpreter where gated_attention cannot be imported, gives the source's logits, saves
    its own files and loads again."""
    expected = {}
    for model_type, (source, _, dst, _) in converted.items():
        with torch.no_grad():
            expected[str(dst)] = source(PROMPT).logits
    torch.save({"ids": PROMPT, "expected": expected}, tmp_path / "expected.pt")
    out = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for i, (folder, logits) in enumerate(data["expected"].items()):
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            assert any(".attn_gate." in name for name, _ in model.named_parameters())
            with torch.no_grad():
                assert torch.equal(model(data["ids"]).logits, logits), folder
            model.save_pretrained({str(tmp_path)!r} + f"/again{{i}}")
            again = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + f"/again{{i}}", trust_remote_code=True)
            with torch.no_grad():
                assert torch.equal(again.eval()(data["ids"]).logits, logits), folder
        print("ok", len(data["expected"]))
        """
    )
    assert out.strip().endswith(f"ok {len(converted)}")


@pytest.mark.parametrize("model_type", ["gemma2", "smollm3"])
def test_generate_with_the_sources_cache_gives_the_sources_tokens(converted, model_type):
    """Greedy decoding past the sliding window (Gemma 2's sliding and full layers) and through layers without
    RoPE (SmolLM3), each with the cache the source's class builds: the exact init keeps every token."""
    source, _, dst, _ = converted[model_type]
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(PROMPT, **kwargs), source.generate(PROMPT, **kwargs))


def test_generate_with_a_hybrid_cache_gives_the_sources_tokens(tmp_path):
    """A hybrid of Mamba-2 and attention layers (Granite 4's), whose cache holds both kinds of state."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(**{**SIZES, "num_hidden_layers": 4}, layer_types=["mamba", "attention"] * 2,
                                    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                    mamba_chunk_size=8, mamba_expand=2, num_local_experts=0)  # fmt: skip
    GraniteMoeHybridForCausalLM(config).save_pretrained(tmp_path / "src")
    convert_checkpoint(str(tmp_path / "src"), tmp_path / "dst", log=lambda line: None)
    source = GraniteMoeHybridForCausalLM.from_pretrained(tmp_path / "src").eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert len(gate_parameters(model)) == 2  # the attention layers' only
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(PROMPT, **kwargs), source.generate(PROMPT, **kwargs))


def test_tensor_parallel_plan_and_peft_find_the_gates(converted):
    """The gate's plan rule sits beside o_proj's (transformers keeps the plan in memory, made as the model is
    built: the base model's, read by vLLM's transformers backend, and the causal LM's); LoRA on o_proj sees the gated
    input (its output projection's hook follows PEFT's wrapper); `modules_to_save=["attn_gate"]` finds the gates
    and nothing else."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    source, _, dst, _ = converted["gemma2"]
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    plan = model.config.base_model_tp_plan
    assert plan["layers.*.self_attn.o_proj"] == "rowwise" and plan["layers.*.self_attn.attn_gate"] == "colwise"
    assert model.tp_plan["model.layers.*.self_attn.attn_gate"] == "colwise"
    assert AutoModel.from_pretrained(dst).tp_plan["layers.*.self_attn.attn_gate"] == "colwise"

    lora = LoraConfig(r=4, target_modules=["o_proj"], modules_to_save=["attn_gate"], init_lora_weights=False)
    torch.manual_seed(1)
    gated = get_peft_model(model, lora)
    torch.manual_seed(1)
    plain = get_peft_model(Gemma2ForCausalLM.from_pretrained(dst.parent / "src").eval(), lora)
    with torch.no_grad():  # gate 0.5 and o_proj doubled: LoRA's branch reads half the input, as halving its B does
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
        assert torch.equal(gated(PROMPT).logits, plain(PROMPT).logits)
    trainable = {n for n, p in gated.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trainable and all(".attn_gate." in n for n in trainable)


def test_a_low_rank_gate_on_part_of_the_input(converted, tmp_path):
    """`--gate-rank` and `--gate-input-channels` (the low-rank gate reading the first channels of the attention's
    input) convert exactly by declaration too; its `up` takes the gate's tensor-parallel rule."""
    _, src, _, _ = converted["gemma2"]
    lines = []
    convert_checkpoint(str(src), tmp_path / "dst", gate_rank=4, gate_input_channels=16, log=lines.append)
    assert "bit-identical after every layer and in the logits" in " ".join(lines)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    down = model.model.layers[0].self_attn.attn_gate.down
    assert (down.in_features, down.out_features) == (16, 4)
    assert model.config.base_model_tp_plan["layers.*.self_attn.attn_gate.up"] == "colwise"


@pytest.mark.parametrize("flags", [["--yarn-factor", "2", "--original-max-position-embeddings", "64"],
                                   ["--rope-theta", "50000"]], ids=["yarn", "theta"])
def test_extend_and_convert_change_rope_on_a_declared_model(converted, tmp_path, flags, capsys):
    source, src, dst, _ = converted["olmo2"]
    assert main(["extend", str(dst), str(tmp_path / "ext"), *flags]) == 0
    assert "bit-identical" in capsys.readouterr().out
    rope = json.loads((tmp_path / "ext" / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == ("yarn" if "--yarn-factor" in flags else "default")
    assert main(["convert", str(src), str(tmp_path / "conv"), *flags]) == 0
    assert json.loads((tmp_path / "conv" / "config.json").read_text())["rope_parameters"] == rope


@pytest.mark.parametrize("model_type, expected", [
    ("deepseek_v3", "is latent attention (MLA: its config sets kv_lora_rank)"),
    ("bert", "BertSelfAttention holds no output projection"),
    ("mamba", "MambaForCausalLM declares no attention modules"),
])  # fmt: skip
def test_what_cannot_be_gated_is_refused_in_one_line(model_type, expected, tmp_path, capsys):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{
        "deepseek_v3": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                            vocab_size=64, n_group=1, topk_group=1),
        "bert": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, vocab_size=64,
                     is_decoder=True),
        "mamba": dict(hidden_size=32, num_hidden_layers=1, vocab_size=64),
    }[model_type])  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    before = file_hashes(tmp_path / "src")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "dst").exists() and staging_leftovers(tmp_path / "dst") == []
    assert file_hashes(tmp_path / "src") == before


def test_learned_sinks_in_a_declared_config_are_refused_not_ignored(tmp_path):
    """`attention_sinks` is this package's field: the source's attention never reads it, so a declared config that
    sets it would load without the sinks it names."""
    from transformers import AutoConfig

    from gated_attention.configuration.declared import declared_config_class

    declared = declared_config_class(Gemma2Config)
    with pytest.raises(ValueError, match="attention_sinks=true is not allowed for a model gated by declaration"):
        declared(**SIZES, attention_sinks=True)
    declared(**SIZES).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_sinks": True}))
    with pytest.raises(ValueError, match="attention_sinks=true is not allowed"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A Gemma 2 DST beside the embedded corpus's tokenizer (its vocabulary), for the commands that read text."""
    from gated_attention.training import data

    folder = tmp_path_factory.mktemp("tokenized")
    tokenizer = data.load_tokenizer(300, max_chars=150_000)
    torch.manual_seed(0)
    config = Gemma2Config(**{**SIZES, "vocab_size": len(tokenizer), **FAMILIES["gemma2"][2]})
    Gemma2ForCausalLM(config).save_pretrained(folder / "src")
    tokenizer.save_pretrained(folder / "src")
    convert_checkpoint(str(folder / "src"), folder / "dst", log=lambda line: None)
    return folder / "dst"


def test_analyze_reads_the_gates(with_tokenizer, tmp_path):
    """`analyze` finds each attention's gate (this package's module) and reports its scores: exactly 0.5 after the
    exact init."""
    import csv

    assert main(["analyze", str(with_tokenizer), "--out", str(tmp_path / "out"), "--max-length", "24",
                 "--bootstrap", "10", "--n-per-domain", "1"]) == 0  # fmt: skip
    with open(tmp_path / "out" / "gates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["layer"]) for r in rows}) == [1, 2]
    assert all(float(r["mean"]) == 0.5 for r in rows), rows[:2]


@pytest.mark.slow
def test_continued_pretraining_under_accelerate_launch_gates_at_their_own_rate(with_tokenizer, tmp_path):
    """examples/continued_pretraining.py on two processes (DDP over gloo, the hooks in every replica): the gates
    train at --gate-lr, the log has the mean gate score, and the final model loads with its gates moved."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GATED_ATTENTION_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(root / "examples"), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(root / "examples" / "continued_pretraining.py"),
           "--model", str(with_tokenizer), "--output-dir", str(tmp_path / "run"), "--steps", "2", "--warmup-steps", "0",
           "--lr", "1e-4", "--gate-lr", "1e-2", "--seq-len", "32", "--batch-size", "2", "--max-chars", "150000",
           "--eval-sequences", "2", "--log-every", "1", "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    assert log[0]["gate_lr"] == 1e-2 and log[0]["lr"] == 1e-4  # no warmup; the schedule scales both alike after
    assert all(r["gate_lr"] == pytest.approx(100 * r["lr"]) and 0 < r["gate_score"] < 1 for r in log), log
    start = gate_parameters(AutoModelForCausalLM.from_pretrained(with_tokenizer))
    final = gate_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final"))
    assert start.keys() == final.keys() and all(not torch.equal(final[n], start[n]) for n in start)
