"""`gated-attention convert`: every dense source family, bit-identical logits, remote code, side files."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from convert_helpers import PROMPT, SOURCE_FAMILIES, file_hashes, make_fla_hybrid_source, make_source
from gated_attention.cli import main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FAMILIES = [*SOURCE_FAMILIES, "fla_hybrid"]
RESULT_CLASS = {"qwen3_moe": "GatedAttentionMoeForCausalLM", "mixtral": "GatedAttentionMoeForCausalLM", "fla_hybrid": "GatedDeltaNetHybridForCausalLM"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each family saved as a multi-shard source, converted in fp32 and bf16 (exact init, verified)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        if family == "fla_hybrid":  # fla cannot run here: the reference is the same weights in our ungated hybrid
            src = make_fla_hybrid_source(root / f"{family}-src", reference=root / f"{family}-reference")
            reference = root / f"{family}-reference"
        else:
            src = reference = make_source(family, root / f"{family}-src")
        (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')  # a side file to be copied
        hashes = file_hashes(src)
        for dtype in DTYPES:
            dst = root / f"{family}-{dtype}"
            code = main(["convert", str(src), str(dst), "--dtype", dtype, "--max-shard-size", "40KB"])
            out[family, dtype] = (reference, dst, code)
        assert file_hashes(src) == hashes, f"{family}: SRC changed"
    return out


CASES = [(family, dtype) for family in sorted(FAMILIES) for dtype in sorted(DTYPES)]


@pytest.mark.parametrize("family, dtype", CASES)
def test_converted_logits_are_bit_identical(converted, family, dtype):
    src, dst, code = converted[family, dtype]
    assert code == 0  # the converter's own verification passed
    source = AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[dtype]).eval()
    result = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(result).__name__ == RESULT_CLASS.get(family, "GatedAttentionForCausalLM")
    assert result.dtype == DTYPES[dtype]
    with torch.no_grad():
        expected, got = source(PROMPT).logits, result(PROMPT).logits
    # Exact init: sigmoid(0) = 0.5 and 2 * W are exact, so not a single bit may differ.
    assert torch.equal(expected, got), (expected.float() - got.float()).abs().max()
    # ...and the gate is really there, with zero weights (a zero-weight gate is how exactness is reached).
    gate = next(layer.self_attn.attn_gate for layer in result.model.layers if hasattr(layer, "self_attn"))
    assert gate.weight.shape == (result.config.num_attention_heads * result.config.head_dim, result.config.hidden_size)
    assert not gate.weight.any()


def test_output_is_sharded_with_index_and_side_files(converted):
    src, dst, _ = converted["qwen2", "float32"]  # qwen2 has tied embeddings
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((dst / s).is_file() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied: the model reuses embed_tokens, as the source did
    assert "model.layers.1.self_attn.attn_gate.weight" in index["weight_map"]
    assert (dst / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert (dst / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    config = json.loads((dst / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_gated_attention.GatedAttentionForCausalLM"
    assert config["attn_gate"]["position"] == "sdpa" and config["attn_gate"]["bias"] is False
    assert config["qkv_bias"] is True and config["attention_bias"] is False
    card = (dst / "README.md").read_text()
    for section in ("## Base model", "## Conversion options", "## What changed", "## How to load", "## How to continue pretraining",
                    "## Quantizing it"):
        assert section in card
    assert "llm-compressor: `[" in card  # the gate ignore list another quantizer takes
    assert not re.search(r"\$\w", card)  # every template field was filled (a regex's `$` is no field)
    assert not list(dst.parent.glob(".*incomplete*"))


def test_converted_models_load_as_remote_code_without_the_package(converted, tmp_path, run_without_package):
    cases = {}
    for family in FAMILIES:
        _, dst, _ = converted[family, "float32"]
        result = AutoModelForCausalLM.from_pretrained(dst).eval()
        with torch.no_grad():
            cases[str(dst)] = result(PROMPT).logits
    torch.save({"ids": PROMPT, "cases": cases}, tmp_path / "expected.pt")
    out = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        for folder, logits in expected["cases"].items():
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                got = model(expected["ids"]).logits
            assert torch.equal(got, logits), (folder, (got - logits).abs().max())
        print("ok", len(expected["cases"]))
        """
    )
    assert out.split() == ["ok", str(len(FAMILIES))]


def test_headwise_exact_and_bias_init_close_but_not_exact(converted, tmp_path, capsys):
    src, _, _ = converted["qwen3", "float32"]
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        expected = source(PROMPT).logits

    assert main(["convert", str(src), str(tmp_path / "headwise"), "--gate", "headwise", "--no-verify"]) == 0
    headwise = AutoModelForCausalLM.from_pretrained(tmp_path / "headwise").eval()
    assert headwise.model.layers[0].self_attn.attn_gate.weight.shape == (4, 64)  # one score per head
    with torch.no_grad():
        assert torch.equal(headwise(PROMPT).logits, expected)

    assert main(["convert", str(src), str(tmp_path / "bias"), "--init", "bias"]) == 0
    assert "near-identity, not exact" in capsys.readouterr().out
    biased = AutoModelForCausalLM.from_pretrained(tmp_path / "bias").eval()
    assert biased.config.attn_gate["bias"] is True
    with torch.no_grad():
        got = biased(PROMPT).logits
    diff = (got - expected).abs().max().item()
    # Every attention output is scaled by sigmoid(10) = 1 - 4.5e-5 instead of exactly 1: the logits move, a little.
    assert diff > 0
    assert diff < 1e-3 * expected.abs().max().item()


def test_low_rank_truncated_gate_converts_exactly_and_learns(converted, tmp_path, capsys):
    src, _, _ = converted["qwen3", "float32"]
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    assert main(["convert", str(src), str(tmp_path / "dst"), "--gate-rank", "4", "--gate-input-channels", "12"]) == 0
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    assert result.config.attn_gate["rank"] == 4 and result.config.attn_gate["input_channels"] == 12
    gate = result.model.layers[0].self_attn.attn_gate
    assert torch.equal(gate.down.weight, torch.eye(4, 12)) and not gate.up.weight.any()
    with torch.no_grad():
        assert torch.equal(result.eval()(PROMPT).logits, source(PROMPT).logits)  # up = 0: sigmoid(0), exact
    result.train()(PROMPT, labels=PROMPT).loss.backward()
    assert gate.up.weight.grad.abs().max() > 0  # down reads 4 channels, so up learns from the first step

    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "too-wide"), "--gate-rank", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("attn_gate.rank=64 is not below 64, the rank of the full gate (128 scores from 64 input "
                        "channels); use rank null for the full gate (--gate-rank, --gate-input-channels)"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "too-wide").exists()


def test_phi3_fused_projections_are_split_into_ours(converted):
    """Phi-3's qkv_proj is q rows, then k, then v; its gate_up_proj is gate rows, then up (Phi3MLP's `chunk(2)`)."""
    src, dst, _ = converted["phi3", "float32"]
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    result = AutoModelForCausalLM.from_pretrained(dst).eval()
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [name for name in index if "qkv_proj" in name or "gate_up_proj" in name]
    attn, mlp = source.model.layers[1].self_attn, source.model.layers[1].mlp
    ours = result.model.layers[1]
    q, k, v = attn.qkv_proj.weight.split([4 * 16, 2 * 16, 2 * 16])  # TINY: 4 heads, 2 key/value heads, head_dim 16
    assert torch.equal(ours.self_attn.q_proj.weight, q) and torch.equal(ours.self_attn.k_proj.weight, k)
    assert torch.equal(ours.self_attn.v_proj.weight, v)
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(ours.mlp.gate_proj.weight, gate) and torch.equal(ours.mlp.up_proj.weight, up)
    assert result.config.sliding_window == 5 and result.config.attention_bias is False


def test_phi3_longrope_converts_bit_identical_past_the_original_length(tmp_path):
    """Phi-3 128k's RoPE: short factors up to `original_max_position_embeddings`, long ones past it (the
    same rotary tables in transformers' Phi-3 and in our Llama-style rotary embedding)."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + i / 10 for i in range(8)],
            "long_factor": [2.0 + i / 5 for i in range(8)], "original_max_position_embeddings": 8}  # fmt: skip
    src = make_source("phi3", tmp_path / "src", rope_parameters=rope)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0  # verified bit-identical on 32 tokens
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert result.config.rope_parameters["rope_type"] == "longrope"
    with torch.no_grad():
        for ids in (PROMPT[:, :6], PROMPT):  # 6 tokens: the short factors; 12 > 8: the long ones
            assert torch.equal(source(ids).logits, result(ids).logits)


def test_hub_id_resolves_from_the_cache_offline(converted, tmp_path, monkeypatch):
    """A cached repo converts offline, `--revision` picks its snapshot, and the card and config.json say which
    commit was read, with the source card's license and the Hub's base_model_relation."""
    import warnings

    from huggingface_hub import ModelCard, constants

    src, _, _ = converted["llama", "float32"]
    main_commit, old_commit = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    for commit, license in ((main_commit, "apache-2.0"), (old_commit, "mit")):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in src.iterdir():
            (snapshot / f.name).write_bytes(f.read_bytes())
        (snapshot / "README.md").write_text(f"---\nlicense: {license}\n---\n# tiny\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main_commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    for revision, commit, license in ((None, main_commit, "apache-2.0"), (old_commit, old_commit, "mit")):
        out = tmp_path / f"out-{commit[:4]}"
        assert main(["convert", "someone/tiny-llama", str(out), "--no-verify",
                     *(["--revision", revision] if revision else [])]) == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # huggingface_hub warns on metadata it cannot read
            card = ModelCard((out / "README.md").read_text())
        assert (card.data.base_model, card.data.base_model_relation, card.data.license) == (
            "someone/tiny-llama", "finetune", license)
        assert f"commit `{commit}`" in card.text and 'revision="COMMIT"' in card.text
        assert json.loads((out / "config.json").read_text())["source_commit"] == commit
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    result = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reference(PROMPT).logits, result(PROMPT).logits)


def test_a_local_source_without_a_card_is_said_to_name_nothing(converted):
    """No license or base model is guessed for a plain local folder; the card says none was found."""
    from huggingface_hub import ModelCard

    _, dst, _ = converted["qwen2", "float32"]
    card = ModelCard((dst / "README.md").read_text())
    assert card.data.base_model is None and card.data.license is None and card.data.base_model_relation == "finetune"
    assert "No license was found" in card.text and "no commit is known" in card.text
    assert json.loads((dst / "config.json").read_text())["source_commit"] is None


def test_moe_source_in_the_fused_in_memory_layout(tmp_path):
    """Checkpoints written from a state dict (not save_pretrained) carry fused experts; both layouts convert."""
    from safetensors.torch import save_file

    legacy = make_source("qwen3_moe", tmp_path / "legacy")
    model = AutoModelForCausalLM.from_pretrained(legacy)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((legacy / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(fused), str(tmp_path / "out")]) == 0  # verified bit-identical against the source
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(model.eval()(PROMPT).logits, result(PROMPT).logits)


EIGHT_EXPERTS = {"qwen3_moe": dict(num_experts=8, norm_topk_prob=False, mlp_only_layers=[]), "mixtral": dict(num_local_experts=8)}


@pytest.mark.parametrize("family", EIGHT_EXPERTS)
def test_moe_with_eight_experts_converts_bit_identically_with_its_experts_aligned(tmp_path, family):
    """The convert catalog's MoE (8 experts, top 2): transformers stacks the source's per-expert tensors into fresh
    memory (64-byte aligned) as it loads, and DST's fused experts, mapped from the file, lie as aligned, so an
    expert that gets one token (torch's CPU grouped_mm rounds that one by the weight's alignment) gives the same
    bits. A DST expert 8 bytes off that boundary gave the catalog's Qwen3-MoE 1.2e-7."""
    src = make_source(family, tmp_path / "src", **EIGHT_EXPERTS[family])
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0  # verified bit-identical against the source
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for model in (reference, result):
        experts = [p for name, p in model.named_parameters() if ".experts." in name]
        assert experts and all(p.data_ptr() % 64 == 0 for p in experts), type(model).__name__
    with torch.no_grad():
        out = reference(PROMPT[:1], output_router_logits=True)
        chosen = [r.topk(reference.config.num_experts_per_tok, dim=-1).indices for r in out.router_logits]
        assert any(1 in torch.bincount(c.flatten()).tolist() for c in chosen)  # an expert with one token
        assert torch.equal(out.logits, result(PROMPT[:1]).logits)


def test_fused_experts_start_on_a_64_byte_boundary_of_their_shard(tmp_path):
    """Tensors marked aligned (fused experts) start on 64-byte boundaries of the file (after a padded header,
    before the others), so transformers' mapped weights lie where torch would allocate them."""
    import struct

    from safetensors.torch import load_file

    from gated_attention.convert.writer import OutputTensor, write_safetensors

    made = {"model.norm.weight": torch.randn(5), "model.layers.0.mlp.experts.gate_up_proj": torch.randn(8, 6, 4),
            "model.layers.0.self_attn.k_norm.weight": torch.randn(3, dtype=torch.bfloat16),
            "lm_head.weight": torch.randn(7, 16)}  # fmt: skip
    tensors = [OutputTensor(name, tuple(t.shape), t.dtype, lambda t=t: t, aligned=".experts." in name) for name, t in made.items()]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    starts = {name: 8 + n + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}
    assert starts["model.layers.0.mlp.experts.gate_up_proj"] % 64 == 0
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == made.keys() and all(torch.equal(loaded[k], made[k]) for k in made)


def test_unchanged_tensors_copied_by_the_kernel_equal_the_read_path(tmp_path, monkeypatch):
    """Tensors that pass through unchanged go file to file (os.copy_file_range); where the OS refuses,
    plain reads take over; the zero gate weights are written from a buffer, never made. All give the same files as
    making and writing every tensor in Python."""
    from gated_attention.convert import plan, writer

    src = make_source("llama", tmp_path / "src")
    copied, made_gates = [], []
    copy_file_range = writer.os.copy_file_range
    monkeypatch.setattr(writer.os, "copy_file_range", lambda *a, **k: copied.append(a[2]) or copy_file_range(*a, **k))

    def recording(name, shape, dtype, make, *args, **kwargs):  # the planner's OutputTensor, noting made gates
        def recorded():
            made_gates.extend([name] if ".attn_gate." in name else [])
            return make()

        return writer.OutputTensor(name, shape, dtype, recorded, *args, **kwargs)

    monkeypatch.setattr(plan, "OutputTensor", recording)
    assert main(["convert", str(src), str(tmp_path / "kernel"), "--no-verify", "--max-shard-size", "40KB"]) == 0
    assert copied  # q/k/v, MLP, norms and embeddings pass through; o_proj (doubled) is made
    assert not made_gates  # the gate weights (zeros) are never made

    def refuse(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(writer.os, "copy_file_range", refuse)
    assert main(["convert", str(src), str(tmp_path / "reads"), "--no-verify", "--max-shard-size", "40KB"]) == 0
    # Every tensor made in Python: `copy_of` and `zeros` read as None and False whatever the planner sets.
    monkeypatch.setattr(writer.OutputTensor, "copy_of", property(lambda self: None, lambda self, value: None))
    monkeypatch.setattr(writer.OutputTensor, "zeros", property(lambda self: False, lambda self, value: None))
    assert main(["convert", str(src), str(tmp_path / "made"), "--no-verify", "--max-shard-size", "40KB"]) == 0
    weights = sorted(p.name for p in (tmp_path / "made").glob("*.safetensors"))
    assert len(weights) > 1
    assert len(made_gates) == 2, made_gates  # one gate weight per layer, made only in the last run
    for name in weights:
        made = (tmp_path / "made" / name).read_bytes()
        assert (tmp_path / "kernel" / name).read_bytes() == made, name
        assert (tmp_path / "reads" / name).read_bytes() == made, name


def test_a_shard_that_ends_in_zeros_has_its_full_size(tmp_path):
    from safetensors.torch import load_file

    from gated_attention.convert.writer import OutputTensor, write_safetensors

    ones = OutputTensor("a", (3, 5), torch.float32, lambda: torch.ones(3, 5))
    zeros = OutputTensor("b", (4, 8), torch.bfloat16, lambda: torch.zeros(4, 8, dtype=torch.bfloat16), zeros=True)
    write_safetensors(tmp_path / "holes.safetensors", [ones, zeros])
    zeros.zeros = False
    write_safetensors(tmp_path / "written.safetensors", [ones, zeros])
    assert (tmp_path / "holes.safetensors").read_bytes() == (tmp_path / "written.safetensors").read_bytes()
    assert torch.equal(load_file(tmp_path / "holes.safetensors")["b"], torch.zeros(4, 8, dtype=torch.bfloat16))
