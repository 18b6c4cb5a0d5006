"""The Gated Attention paper's own checkpoints: read, converted, analysed and exported with its code's numbers.

tests/data/paper_layouts/ was written by the paper's own code (`modeling_qwen3.py`, on transformers 4.51.3,
by tests/paper_reference.py; manifest.json says which commit): one tiny bf16 model per layout (elementwise,
headwise, baseline; 4 query heads over 4, 2 and 1 key/value heads; q/k norm off; bias on), each with its
reference outputs in fp32: logits (SDPA), eager attention maps, greedy tokens. Their code is never run here.

Tolerances:
- logits within 1e-5 (|logits| up to ~6 here): both sides are fp32 with the same weights, but two transformers
  releases' kernels (4.51's and this one's RoPE, RMSNorm, SDPA dispatch, the paper's own q/gate split against
  separate projections) add in different orders; the rounding that leaves is a few 1e-6 (measured at most
  2.2e-6), and a misplaced row or a lost bias moves them by 1e-1 or more.
- attention maps within 1e-6: softmax probabilities in fp32 from the same scores, except that the paper's
  code divides q.k by sqrt(D) and transformers multiplies by 1/sqrt(D) (measured at most 3.9e-7).
- greedy tokens: equal.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gated_attention as ga
from gated_attention.cli import main
from gated_attention.convert.convert import convert_checkpoint
from gated_attention.convert.errors import ConversionError
from gated_attention.convert.families import detect_family
from gated_attention.hub.paper_layout import NAME, PaperLayout

DATA = Path(__file__).resolve().parent / "data" / "paper_layouts"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
LAYOUTS = list(MANIFEST["layouts"])
GATED = [name for name in LAYOUTS if name != "baseline"]
LOGITS_ATOL, ATTENTION_ATOL = 1e-5, 1e-6
pytestmark = pytest.mark.filterwarnings("ignore:mlx-lm will not run this export")
quiet = lambda message: None  # noqa: E731


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(DATA / name / "reference.safetensors")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """Every layout converted as `gated-attention convert` does, keeping its own gate (and the baseline none)."""
    root = tmp_path_factory.mktemp("paper")
    for name in LAYOUTS:
        convert_checkpoint(str(DATA / name), root / name, log=quiet)
    return root


@torch.no_grad()
def outputs(folder: Path, ref: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits (SDPA), eager attention maps [L, B, H, T, T] and greedy tokens of the model in `folder`."""
    model = ga.GatedAttentionForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = model(ref["input_ids"]).logits
    model.set_attn_implementation("eager")
    attentions = torch.stack(model(ref["input_ids"], output_attentions=True).attentions)
    model.set_attn_implementation("sdpa")
    prompt = ref["prompt"]
    greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=ref["greedy"].shape[1], min_new_tokens=ref["greedy"].shape[1],
                            eos_token_id=None, pad_token_id=0)[:, prompt.shape[1]:]  # fmt: skip
    return logits, attentions, greedy


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_conversion_gives_the_papers_own_numbers(name, converted):
    ref, layout = reference(name), MANIFEST["layouts"][name]
    config = ga.GatedAttentionConfig.from_pretrained(converted / name)
    gate = config.attn_gate
    if layout["headwise_attn_output_gate"] or layout["elementwise_attn_output_gate"]:
        own = "headwise" if layout["headwise_attn_output_gate"] else "elementwise"
        assert (gate["position"], gate["granularity"], gate["activation"]) == ("sdpa", own, "sigmoid")
        assert gate["bias"] is layout["qkv_bias"]
    else:
        assert gate["position"] is None  # the baseline stays ungated
    assert (config.qk_norm, config.attention_bias, config.qkv_bias) == (layout["use_qk_norm"], layout["qkv_bias"], False)
    assert config.num_key_value_heads == layout["num_key_value_heads"]

    logits, attentions, greedy = outputs(converted / name, ref)
    assert (logits - ref["logits"]).abs().max().item() <= LOGITS_ATOL
    assert (attentions - ref["attentions"]).abs().max().item() <= ATTENTION_ATOL
    assert torch.equal(greedy, ref["greedy"])


def test_the_layout_is_read_from_the_flags_and_a_plain_qwen3_stays_a_qwen3():
    paper = json.loads((DATA / "headwise-gqa2" / "config.json").read_text())
    assert detect_family(paper).name == NAME
    plain = {k: v for k, v in paper.items() if k not in ("headwise_attn_output_gate", "elementwise_attn_output_gate",
                                                        "use_qk_norm", "qkv_bias", "auto_map")}
    assert detect_family(plain).name == "Qwen3"
    # q_proj's rows: per key/value group, its 2 heads' 16 query rows, then their 2 gate scores
    layout = PaperLayout.from_config(paper)
    assert layout.rows() == {"q_proj": [*range(0, 16), *range(18, 34)], "attn_gate": [16, 17, 34, 35]}


def test_the_baseline_gets_a_gate_only_when_asked_and_then_starts_exactly(tmp_path, capsys):
    """With --gate the baseline is any Qwen3: exact init, verified bit-identical against transformers' Qwen3
    running the source (the paper's baseline has q/k norms, so that class runs it as the paper's code does)."""
    assert main(["convert", str(DATA / "baseline"), str(tmp_path / "gated"), "--gate", "headwise"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical after every layer" in out, out
    assert ga.GatedAttentionConfig.from_pretrained(tmp_path / "gated").attn_gate["granularity"] == "headwise"


@pytest.mark.parametrize("argv, message", [
    (["--gate", "elementwise"], "--gate elementwise contradicts SRC's own headwise gate (Gated Attention paper); "
                                "leave --gate out to keep it"),
    (["--init", "bias"], "--init bias sets up a new gate, and SRC has its own headwise gate, which is kept as "
                         "trained; leave --init out"),
], ids=["gate", "init"])
def test_an_option_that_contradicts_the_checkpoints_own_gate_is_one_line(argv, message, tmp_path, capsys):
    assert main(["convert", str(DATA / "headwise-gqa2"), str(tmp_path / "dst"), *argv]) == 2
    assert capsys.readouterr().err.strip() == f"gated-attention convert: error: {message}"
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("edit, message", [
    ({"use_sliding_window": True, "sliding_window": 4},
     "SRC's Gated Attention paper config is not supported: use_sliding_window=true: the paper's code windows "
     "attention only under flash-attention 2, so the model's outputs depend on the kernel it ran with"),
    ({"use_qk_norm": "yes"},
     "SRC's Gated Attention paper config is not supported: use_qk_norm = 'yes' is a str, expected true or false"),
    ({"headwise_attn_output_gate": False, "elementwise_attn_output_gate": True},  # flags that the weights deny
     "tensor model.layers.0.self_attn.q_proj.weight has 36 rows, and the paper's layout with elementwise gate: 4 "
     "heads of 8 in 2 key/value group(s); q_proj packs per group 16 query rows then 16 gate rows, 64 in all: "
     "config.json and the weights disagree"),
], ids=["sliding-window", "flag-type", "flags-against-q_proj"])
def test_what_cannot_be_read_exactly_is_one_line_naming_it(edit, message, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "headwise-gqa2", src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConversionError) as error:
        convert_checkpoint(str(src), tmp_path / "dst", log=quiet)
    assert str(error.value) == message
    assert not (tmp_path / "dst").exists()


def _vocabulary_tokenizer(vocab_size: int):
    """A BPE tokenizer of at most `vocab_size` tokens (the fixtures' vocabulary is 64), trained on the samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from gated_attention.analysis.samples import builtin_samples

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<unk>"], limit_alphabet=40)
    tok.train_from_iterator([s.text for s in builtin_samples(1)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


def test_analyze_on_the_papers_folder_equals_analyze_on_its_conversion(converted, tmp_path):
    """Side by side, as for the released baseline and gated models: the paper's folder read in memory gives every
    table of the analysis of its converted folder, to the byte."""
    tokenizer = _vocabulary_tokenizer(64)
    folders = {}
    for name in ("baseline", "headwise-gqa2"):
        folders[name] = tmp_path / "paper" / name
        shutil.copytree(DATA / name, folders[name])
        shutil.copytree(converted / name, tmp_path / "converted" / name)
        for folder in (folders[name], tmp_path / "converted" / name):
            tokenizer.save_pretrained(folder)
    common = ["--n-per-domain", "1", "--max-length", "16", "--bootstrap", "10"]
    assert main(["analyze", *map(str, folders.values()), "--out", str(tmp_path / "paper-out"), *common]) == 0
    assert main(["analyze", *(str(tmp_path / "converted" / n) for n in folders), "--out", str(tmp_path / "conv-out"),
                 *common]) == 0  # fmt: skip
    for name in folders:
        for table in ("inputs.csv", "layers.csv", "gates.csv", "metrics.csv", "peak_excess.csv"):
            paper, conv = (tmp_path / out / name / table for out in ("paper-out", "conv-out"))
            assert paper.read_text() == conv.read_text(), (name, table)
    with open(tmp_path / "paper-out" / "headwise-gqa2" / "gates.csv", newline="") as f:
        assert {row["layer"] for row in csv.DictReader(f)} == {"1", "2"}  # the gate's scores were captured


@pytest.mark.parametrize("name", [n for n in GATED if MANIFEST["layouts"][n]["use_qk_norm"]])
def test_an_export_to_qwen3_5_gives_the_papers_own_logits(name, tmp_path):
    """Qwen3.5's gate is the paper's elementwise one; a headwise score becomes D equal elementwise rows.

    Converted in float32: Qwen3.5 stores each norm weight as w - 1, which bf16 cannot hold for a weight below
    0.5 (these have some, as trained models do), so a bf16 conversion is refused (next test)."""
    from transformers import Qwen3_5ForCausalLM

    from gated_attention.convert.export import export_checkpoint

    convert_checkpoint(str(DATA / name), tmp_path / "converted", dtype="float32", verify=False, log=quiet)
    export_checkpoint(str(tmp_path / "converted"), tmp_path / "native", verify=False, log=quiet)
    model = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32).eval()
    ref = reference(name)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert (logits - ref["logits"]).abs().max().item() <= LOGITS_ATOL


def test_what_the_export_cannot_write_exactly_is_one_line(converted, tmp_path):
    from gated_attention.convert.export import export_checkpoint

    with pytest.raises(ConversionError, match=r"^cannot export to qwen3_5 exactly: norm weight model\.layers\.0\."
                                              r"post_attention_layernorm\.weight\[5\] = 0\.423828125 is not 1 \+ w "
                                              r"for any torch\.bfloat16 w; convert SRC's source with --dtype float32"):
        export_checkpoint(str(converted / "headwise-mha"), tmp_path / "native", verify=False, log=quiet)
    with pytest.raises(ConversionError, match=r"^cannot export to qwen3_5 exactly: Qwen3\.5 always applies RMSNorm "
                                              r"to q and k; this model has qk_norm=false; "):
        export_checkpoint(str(converted / "elementwise-no-qk-norm"), tmp_path / "native", verify=False, log=quiet)


def test_a_folder_of_a_cached_hub_repo_converts_and_analyses_offline(tmp_path, monkeypatch, capsys):
    """`QwQZh/gated_attention/1B_gate_headwise` spells a folder of a repo that holds several models; here the
    repo is a fake Hugging Face cache holding two of the fixtures, read with HF_HUB_OFFLINE set."""
    from huggingface_hub import constants

    commit = "2" * 40
    repo = tmp_path / "hub" / "models--QwQZh--gated_attention"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name in ("baseline", "headwise-gqa2"):
        shutil.copytree(DATA / name, repo / "snapshots" / commit / name)
    _vocabulary_tokenizer(64).save_pretrained(repo / "snapshots" / commit / "headwise-gqa2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert main(["convert", "QwQZh/gated_attention/headwise-gqa2", str(tmp_path / "dst"), "--no-verify"]) == 0
    assert ga.GatedAttentionConfig.from_pretrained(tmp_path / "dst").attn_gate["granularity"] == "headwise"
    assert "base_model: QwQZh/gated_attention\n" in (tmp_path / "dst" / "README.md").read_text()
    assert main(["analyze", "QwQZh/gated_attention/headwise-gqa2", "--out", str(tmp_path / "out"), "--n-per-domain",
                 "1", "--max-length", "16", "--bootstrap", "10"]) == 0  # fmt: skip
    assert (tmp_path / "out" / "gates.csv").is_file()  # one MODEL: its tables in DIR itself
    capsys.readouterr()
    assert main(["convert", "QwQZh/gated_attention/elementwise-mqa", str(tmp_path / "dst2")]) == 2
    assert capsys.readouterr().err.strip() == ("gated-attention convert: error: SRC QwQZh/gated_attention/elementwise-mqa: "
                                               "no such folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is "
                                               "set): its cached snapshot of QwQZh/gated_attention has no folder "
                                               "elementwise-mqa")
    # a folder cached with its config.json alone: a download cut short, no pickle checkpoint to convert first
    (repo / "snapshots" / commit / "config-only").mkdir()
    shutil.copy(DATA / "headwise-gqa2" / "config.json", repo / "snapshots" / commit / "config-only")
    text = tmp_path / "text.txt"
    text.write_text("word " * 100)
    for argv in (["analyze", "QwQZh/gated_attention/config-only", "--out", str(tmp_path / "out3")],
                 ["stream", "QwQZh/gated_attention/config-only", "--text-file", str(text), "--window", "8", "--out",
                  str(tmp_path / "out3")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith("checkpoint, but its folder is not whole (it holds config.json but no weight file): fetch "
                            "it again with the network allowed"), err
        assert not (tmp_path / "out3").exists()
