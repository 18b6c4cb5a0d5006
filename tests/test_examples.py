"""The accelerate examples on a tiny gated model: DDP on two CPU processes, resume, LoRA merge and reload,
and the long-context recipe (RoPE base change, training, YaRN evaluation and checkpoint).

Two processes on a CPU-only machine: `accelerate launch --cpu --num_processes 2`
starts a single process unless MPI is installed, so the tests use the
torchrun launcher (`--multi_gpu`); the examples pick the CPU and gloo when there
is no accelerator. Each process is limited to one thread (2 cores).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import gated_attention
from gated_attention.training import data
from gated_attention.training import evaluate_loss

from example_helpers import import_example, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MAX_CHARS = 150_000  # a corpus prefix: tokenizer training and tokenizing take well under a second
COMMON = ["--seq-len", "32", "--batch-size", "2", "--max-chars", str(MAX_CHARS), "--eval-sequences", "2",
          "--log-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("GATED_ATTENTION_CACHE")
    os.environ["GATED_ATTENTION_CACHE"] = str(cache)
    # Prepended, not replaced: a PYTHONPATH that points at this checkout must reach the children.
    pythonpath = os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    yield {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    if old is None:
        os.environ.pop("GATED_ATTENTION_CACHE")
    else:
        os.environ["GATED_ATTENTION_CACHE"] = old


@pytest.fixture(scope="module")
def tiny_model(env, tmp_path_factory) -> Path:
    """A tiny random G1-gated model with the embedded tokenizer, saved like a converted checkpoint."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), MAX_CHARS, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, max_position_embeddings=64)


def launch_two_processes(script: str, args: list[str], env: dict) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def read_log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_continued_pretraining_ddp_resume_and_reload(env, tiny_model, tmp_path):
    # lr 1e-2 so that a resume that lost the optimizer or scheduler state would change
    # the later losses visibly (Adam's update is ~lr per weight).
    train_args = ["--model", str(tiny_model), "--steps", "4", "--save-every", "2", "--grad-accum", "2",
                  "--lr", "1e-2", "--gate-lr", "2e-2", *COMMON]
    first = tmp_path / "first"
    out = launch_two_processes("continued_pretraining.py", [*train_args, "--output-dir", str(first)], env)
    assert "2 process(es)" in out
    log = read_log(first)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 0 < r["gate_score"] < 1 for r in log)
    assert log[0]["gate_lr"] > log[0]["lr"]  # the gate group has its own learning rate

    # Resume from the step-2 checkpoint into a fresh folder: steps 3 and 4 must be the same
    # batches (digest of the global row indices) and, with the same two processes and the
    # same deterministic gloo reductions, the same losses.
    resumed = tmp_path / "resumed"
    out = launch_two_processes(
        "continued_pretraining.py",
        [*train_args, "--output-dir", str(resumed), "--resume", str(first / "checkpoints" / "step-0000002")], env
    )
    assert "at step 2" in out
    log_resumed = read_log(resumed)
    assert [r["step"] for r in log_resumed] == [3, 4]
    assert [r["batch"] for r in log_resumed] == [r["batch"] for r in log[2:]]
    assert len({r["batch"] for r in log}) == 4
    for a, b in zip(log_resumed, log[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["gate_score"] == pytest.approx(b["gate_score"], rel=1e-6, abs=0)

    # The saved folders reload through the remote-code bundle, and both runs ended at the same weights.
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(first / "final", trust_remote_code=True)
    b = AutoModelForCausalLM.from_pretrained(resumed / "final", trust_remote_code=True)
    assert a.config.attn_gate["position"] == "sdpa"
    start = gated_attention.GatedAttentionForCausalLM.from_pretrained(tiny_model).state_dict()
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)
    gate_names = [n for n in start if "attn_gate" in n]
    assert gate_names and all(not torch.equal(a.state_dict()[n], start[n]) for n in gate_names)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    assert torch.isfinite(a(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_lora_merge_save_reload_same_logits(env, tiny_model, tmp_path):
    lora = import_example("lora_finetune")
    out = tmp_path / "lora"
    merged = lora.main(["--model", str(tiny_model), "--output-dir", str(out), "--steps", "3", "--rank", "4",
                        "--lr", "1e-2", *COMMON])
    assert type(merged).__name__ == "GatedAttentionForCausalLM"  # unwrapped: no PEFT layers left
    assert "base_model_relation: finetune" in (out / "merged" / "README.md").read_text()  # merged: a full model
    assert not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    start = gated_attention.GatedAttentionForCausalLM.from_pretrained(tiny_model).state_dict()
    state = merged.state_dict()
    # The gates were trained in full (modules_to_save) and the LoRA deltas were merged.
    assert not torch.equal(state["model.layers.0.self_attn.attn_gate.weight"], start["model.layers.0.self_attn.attn_gate.weight"])
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], start["model.embed_tokens.weight"])  # not a LoRA target

    ids = torch.randint(3, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = merged.eval()(input_ids=ids).logits
    # Reload in a fresh interpreter through the remote-code bundle; fp32 weights round-trip
    # through safetensors exactly and the arithmetic is the same code, so the logits are equal.
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'merged')!r}, trust_remote_code=True)\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m.eval()(input_ids=ids).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "logits.pt"), before)


@pytest.mark.slow
def test_qlora_trains_on_a_4bit_base_and_merges_onto_full_precision(env, tmp_path, monkeypatch, capsys):
    """--load-in-4bit: every Linear layer but the gates and lm_head is NF4 while training and the gates train in
    float32; the merged model is the float32 base plus the trained deltas, and reloads with the same logits.

    The gates are low-rank (two nn.Linear each): transformers leaves tiny_model's full-rank gate (a subclass of
    nn.Linear) unquantized whatever the skip list says, so only these show that the script keeps gates out."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    model = save_tiny_model(tmp_path / "tiny", MAX_CHARS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            max_position_embeddings=64, attn_gate={"position": "G1", "rank": 4})
    lora = import_example("lora_finetune")
    load_base, bases = lora.load_base, []

    def keep(*args):  # the model that trains, to look at after the run
        bases.append(load_base(*args))
        return bases[-1]

    monkeypatch.setattr(lora, "load_base", keep)
    out = tmp_path / "qlora"
    merged = lora.main(["--model", str(model), "--output-dir", str(out), "--steps", "3", "--rank", "4",
                        "--lr", "1e-2", "--gate-lr", "1e-2", "--load-in-4bit", *COMMON])
    trained = bases[0]  # with the LoRA layers get_peft_model put into it
    linears = {n: m for n, m in trained.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    four_bit = {n for n, m in linears.items() if isinstance(m, bnb.nn.Linear4bit)}
    assert four_bit == {n for n in linears if "attn_gate" not in n and n != "lm_head"} and len(four_bit) == 2 * 7
    assert {linears[n].weight.quant_type for n in four_bit} == {"nf4"}
    kept = [m.weight for n, m in linears.items() if n not in four_bit]  # gates (trained copy and original), lm_head
    assert all(type(w) is torch.nn.Parameter and w.dtype == torch.float32 for w in kept)

    start = gated_attention.GatedAttentionForCausalLM.from_pretrained(model).state_dict()
    state = merged.state_dict()
    gates = {n.replace("modules_to_save.default.", ""): p for n, p in trained.named_parameters()
             if "attn_gate" in n and p.requires_grad}
    assert sorted(gates) == [f"model.layers.{i}.self_attn.attn_gate.{w}.weight" for i in (0, 1) for w in ("down", "up")]
    for name, p in gates.items():
        assert not torch.equal(p, start[name]) and torch.equal(state[name], p)
    # Merged onto the float32 base, not the dequantized 4-bit one (which is ~1e-2 off): W + delta - W is delta
    # up to float32 rounding of W + delta, half an ulp of |W| < 1, i.e. under 6e-8.
    adapted = {n: m for n, m in trained.named_modules() if isinstance(m, LoraLayer)}
    assert len(adapted) == 2 * 7
    for name, layer in adapted.items():
        torch.testing.assert_close(state[f"{name}.weight"] - start[f"{name}.weight"],
                                   layer.get_delta_weight("default"), rtol=0, atol=1e-7)
    assert torch.equal(state["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    # The run prints how far the merged logits lie from the 4-bit model's: NF4's error on these random weights
    # moves them by about 1e-2. On the CPU the 4-bit layers compute with their dequantized weights exactly, so a
    # merge onto those would leave float rounding alone, far under 1e-4.
    quantization_error = float(re.search(r"from the 4-bit model as trained (\S+)", capsys.readouterr().out)[1])
    assert 1e-4 < quantization_error < 0.1

    with safe_open(out / "merged" / "model.safetensors", "pt") as saved:
        assert not any("lora_" in k or "modules_to_save" in k for k in [*saved.keys(), *state])
    # In this interpreter the package's registered class reads the folder, not its remote-code bundle: the
    # bundle is the same for every merge and test_lora_merge_save_reload_same_logits loads it in a fresh one.
    reloaded = AutoModelForCausalLM.from_pretrained(out / "merged", trust_remote_code=True)
    ids = torch.randint(3, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # fp32 weights round-trip through safetensors exactly: the same logits
        assert torch.equal(reloaded.eval()(input_ids=ids).logits, merged.eval()(input_ids=ids).logits)


def test_long_context_table_and_yarn_checkpoint(env, tiny_model, tmp_path):
    """examples/long_context.py: RoPE base change, training at 80 tokens (the model has 64 positions: with a
    RoPE change that is allowed), perplexity by length with and without YaRN.

    The YaRN column is computed in memory (`with_rope`); OUTPUT/final-yarn is written separately by
    `extend_checkpoint`. Loaded from disk, that checkpoint must reproduce the column.
    """
    long_context = import_example("long_context")
    out = tmp_path / "long"
    rows = long_context.main(["--model", str(tiny_model), "--output-dir", str(out), "--rope-theta", "50000",
                              "--steps", "2", "--eval-lengths", "32", "160", "--yarn-factor", "2",
                              *COMMON, "--seq-len", "80"])
    with open(out / "perplexity_by_length.csv", newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [int(r["length"]) for r in table] == [32, 160]
    for r in table:
        values = [float(r[k]) for k in ("before", "rope_base_trained", "rope_base_trained_yarn")]
        assert all(math.isfinite(v) and v > 1 for v in values), r
    assert [r["rope_base_trained_yarn"] for r in rows] == [float(r["rope_base_trained_yarn"]) for r in table]

    final = json.loads((out / "final" / "config.json").read_text())
    yarn = json.loads((out / "final-yarn" / "config.json").read_text())
    assert final["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "default"}
    assert yarn["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 2.0,
                                       "original_max_position_embeddings": 80}
    assert final["max_position_embeddings"] == 80 and yarn["max_position_embeddings"] == 160

    model = AutoModelForCausalLM.from_pretrained(out / "final-yarn")
    tokenizer = data.tokenizer_for(str(tiny_model), vocab_size=model.config.vocab_size)
    valid = data.packed_rows(tokenizer, 160, split="validation", max_chars=MAX_CHARS, max_rows=2)
    assert math.exp(evaluate_loss(model, valid, 2)) == pytest.approx(rows[1]["rope_base_trained_yarn"], rel=1e-6)


def write_jsonl_corpus(folder: Path, files: int) -> list[str]:
    """The embedded corpus's training prefix as 300-character documents in `files` jsonl files."""
    text = "".join(d.text for d in data.corpus_split("train", MAX_CHARS))
    docs = [text[i : i + 300] for i in range(0, len(text), 300)]
    paths = []
    for k in range(files):
        path = folder / f"part-{k}.jsonl"
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs[k::files])))
        paths.append(str(path))
    return paths


@pytest.mark.slow
def test_streamed_jsonl_two_processes_resume_latest(env, tiny_model, tmp_path):
    """--dataset with two jsonl files on two gloo processes (one file each), then `--resume latest`
    from the step-2 checkpoint: steps 3 and 4 read the same batches (digests of the tokens of the
    global batch) with the same losses."""
    files = write_jsonl_corpus(tmp_path, 2)
    train_args = ["--model", str(tiny_model), "--dataset", *files, "--steps", "4", "--save-every", "2",
                  "--grad-accum", "2", "--lr", "1e-2", "--gate-lr", "2e-2", *COMMON]
    first = tmp_path / "first"
    out = launch_two_processes("continued_pretraining.py", [*train_args, "--output-dir", str(first)], env)
    assert "streaming" in out and "2 process(es)" in out
    log = read_log(first)
    assert [r["step"] for r in log] == [1, 2, 3, 4] and len({r["batch"] for r in log}) == 4
    positions = [json.loads((first / "checkpoints" / "step-0000002" / f"data_state_{r}.json").read_text())
                 for r in range(2)]
    assert [p["rank"] for p in positions] == [0, 1] and all(p["offset"] > 0 for p in positions)

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(first / "checkpoints" / "step-0000002", resumed / "checkpoints" / "step-0000002")
    out = launch_two_processes("continued_pretraining.py",
                               [*train_args, "--output-dir", str(resumed), "--resume", "latest"], env)
    assert "at step 2" in out
    log_resumed = read_log(resumed)
    assert [r["step"] for r in log_resumed] == [3, 4]
    assert [r["batch"] for r in log_resumed] == [r["batch"] for r in log[2:]]
    for a, b in zip(log_resumed, log[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)


@pytest.mark.slow
def test_streamed_parquet_two_processes(env, tiny_model, tmp_path):
    """--dataset with one parquet file on two gloo processes: each keeps every other document
    (datasets' split when there are fewer files than processes); the rows are those of the
    single-process stream of each half, so the step-1 digest can be recomputed here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gated_attention.training.streaming import rows_digest, text_stream

    text = "".join(d.text for d in data.corpus_split("train", MAX_CHARS))
    docs = [text[i : i + 300] for i in range(0, len(text), 300)]
    pq.write_table(pa.table({"body": docs}), tmp_path / "corpus.parquet", row_group_size=64)
    out_dir = tmp_path / "out"
    launch_two_processes("continued_pretraining.py",
                         ["--model", str(tiny_model), "--dataset", str(tmp_path / "corpus.parquet"), "--text-field",
                          "body", "--steps", "2", "--output-dir", str(out_dir), *COMMON], env)
    log = read_log(out_dir)
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)

    tokenizer = data.tokenizer_for(str(tiny_model))
    local = [text_stream(str(tmp_path / "corpus.parquet"), tokenizer, 32, text_field="body", rank=r, world=2)
             for r in range(2)]
    digests = torch.tensor([rows_digest(s.next_rows(2)) for s in local], dtype=torch.int64)  # rank-major
    assert log[0]["batch"] == hashlib.sha1(digests.numpy().tobytes()).hexdigest()[:12]


def test_token_shards_train_and_resume(env, tiny_model, tmp_path):
    """examples/tokenize_corpus.py, then continued pretraining from the shards (one process): the rows
    are addressed by (seed, step), so a resume from the step-1 checkpoint repeats step 2's batch."""
    tokenize = import_example("tokenize_corpus")
    files = write_jsonl_corpus(tmp_path, 2)
    index = tokenize.main(["--model", str(tiny_model), "--dataset", *files, "--output", str(tmp_path / "tokens")])
    assert index["dtype"] == "uint16" and index["tokens"] > 10_000

    cpt = import_example("continued_pretraining")
    args = ["--model", str(tiny_model), "--dataset", str(tmp_path / "tokens"), "--steps", "2", "--save-every", "1",
            "--lr", "1e-2", *COMMON]
    cpt.main([*args, "--output-dir", str(tmp_path / "a")])
    cpt.main([*args, "--output-dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a/checkpoints/step-0000001")])
    first, resumed = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert [r["step"] for r in resumed] == [2] and resumed[0]["batch"] == first[1]["batch"]
    assert resumed[0]["loss"] == pytest.approx(first[1]["loss"], rel=1e-6, abs=0)


def test_the_saved_model_has_a_card_and_is_pushed_after_the_run(env, tiny_model, tmp_path, monkeypatch, capsys):
    """The final model's card names its base and relation; --push-to-hub uploads final/ whole, once the run
    is done, and a refused push is one line and exit status 2 with final/ left as saved."""
    from huggingface_hub import ModelCard

    from test_hub_push import FakeHub

    cpt = import_example("continued_pretraining")
    hub = FakeHub().install(monkeypatch)
    args = ["--model", str(tiny_model), "--steps", "1", "--eval-sequences", "0", *COMMON, "--push-to-hub", "me/cpt"]
    cpt.main([*args, "--output-dir", str(tmp_path / "a"), "--private"])
    final = tmp_path / "a" / "final"
    card = ModelCard((final / "README.md").read_text())
    assert (card.data.base_model_relation, card.data.license) == ("finetune", None)
    assert "--gate-lr" in card.text and 'revision="COMMIT"' in card.text
    (_, repo, flags), (_, _, upload) = hub.calls
    assert (repo, flags["private"], upload["folder_path"]) == ("me/cpt", True, str(final))
    assert {"README.md", "config.json", "modeling_gated_attention.py", "model.safetensors"} <= set(upload["files"])
    assert "pushed" in capsys.readouterr().out

    FakeHub(fail=True).install(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        cpt.main([*args, "--output-dir", str(tmp_path / "b")])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "403 Forbidden" in err[0] and "hf upload me/cpt" in err[0]
    assert {p.name for p in (tmp_path / "b" / "final").iterdir()} == {p.name for p in final.iterdir()}


def test_resume_from_a_folder_that_is_no_checkpoint_is_one_line(env, tiny_model, tmp_path, capsys):
    """The error comes after the output folder was made: the run removes the folders it made (still empty),
    never one that was there before, nor what was in it."""
    cpt = import_example("continued_pretraining")
    args = ["--model", str(tiny_model), "--steps", "1", "--resume", str(tmp_path / "kept"), *COMMON]
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    expected = {
        tmp_path / "runs" / "e1": f"error: {tmp_path / 'kept'} is not a complete checkpoint (no step.json)",
        # a folder of the user's files is no run's output folder: refused before anything
        tmp_path / "kept": f"error: --output-dir {tmp_path / 'kept'} holds 'notes.txt' and is not a run",
    }
    for out, line in expected.items():
        with pytest.raises(SystemExit) as exit_info:
            cpt.main([*args, "--output-dir", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(line), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # runs/ and runs/e1 are gone
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------- bad input: one line, nothing left behind


@pytest.fixture(scope="module")
def bad_inputs(env, tiny_model, tmp_path_factory) -> Path:
    """A folder of inputs the examples must refuse: empty files and folders, files that are not (whole) JSON
    lines or lack the text field, a masked LM, the tiny model under configs that do not fit its 2 layers."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    folder = tmp_path_factory.mktemp("bad")
    (folder / "empty.txt").write_text("")
    (folder / "empty.jsonl").write_text("")
    (folder / "not_json.jsonl").write_text("one line of plain text\nand another\n")
    (folder / "truncated.jsonl").write_text('{"text": "a whole document"}\n{"text": "cut off in the mid')
    (folder / "other_field.jsonl").write_text('{"body": "a document under another name"}\n')
    (folder / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (folder / "nul.jsonl").write_bytes(b"\0" * 1000)  # space preallocated, never written
    (folder / "empty_folder").mkdir()
    tokenizer = data.load_tokenizer(300, max_chars=MAX_CHARS)
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    DistilBertForMaskedLM(config).save_pretrained(folder / "distilbert")  # random weights, built here
    tokenizer.save_pretrained(folder / "distilbert")
    for layers in (1, 3):
        shutil.copytree(tiny_model, folder / f"{layers}-layer-config")
        config = json.loads((tiny_model / "config.json").read_text())
        config.pop("layer_types", None)
        (folder / f"{layers}-layer-config" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return folder


BAD_INPUTS = {  # id: (arguments, the start of the error line); {bad} is the bad_inputs folder
    "missing model": (["--model", "./nope"], "error: --model ./nope: no such folder"),
    "masked LM": (["--model", "{bad}/distilbert"], "error: --model {bad}/distilbert: a 'distilbert' model "
                  "(DistilBertConfig) is not a causal LM"),
    "config says 3 layers, weights 2": (["--model", "{bad}/3-layer-config"],
                                        "error: --model {bad}/3-layer-config: its weights lack tensor "
                                        "model.layers.2.input_layernorm.weight (and 9 more), which its config implies"),
    "config says 1 layer, weights 2": (["--model", "{bad}/1-layer-config"],
                                       "error: --model {bad}/1-layer-config: its weights hold tensor "
                                       "model.layers.1.input_layernorm.weight (and 9 more), which a gated_attention "
                                       "model with its config does not have"),
    "empty text file": (["--text-files", "{bad}/empty.txt"],
                        "error: --text-files {bad}/empty.txt: too little text for one row of 32 tokens"),
    "empty folder": (["--text-files", "{bad}/empty_folder"],
                     "error: --text-files {bad}/empty_folder: no *.txt file in this folder"),
    "missing text file": (["--text-files", "{bad}/missing.txt"],
                          "error: --text-files {bad}/missing.txt: no such file or folder"),
    "empty validation file": (["--valid-files", "{bad}/empty.txt"],
                              "error: --valid-files {bad}/empty.txt: too little text for one row of 32 tokens"),
    "empty dataset": (["--dataset", "{bad}/empty.txt"], "error: --dataset {bad}/empty.txt: the file is empty"),
    "blank documents": (["--dataset", "{bad}/blank.jsonl"],
                        "error: --dataset {bad}/blank.jsonl: no document has text in its 'text' column"),
    "missing dataset": (["--dataset", "{bad}/missing.jsonl"], "error: --dataset {bad}/missing.jsonl: no such file"),
    "empty jsonl": (["--dataset", "{bad}/empty.jsonl"], "error: --dataset {bad}/empty.jsonl: the file is empty"),
    "not JSON": (["--dataset", "{bad}/not_json.jsonl"],
                 "error: --dataset {bad}/not_json.jsonl: cannot be read (JSON parse error: Invalid value."),
    "truncated JSON": (["--dataset", "{bad}/truncated.jsonl"],
                       "error: --dataset {bad}/truncated.jsonl: line 2 cannot be read (Unterminated string starting "
                       "at character 10)"),
    "all NUL bytes": (["--dataset", "{bad}/nul.jsonl"],
                      "error: --dataset {bad}/nul.jsonl: {bad}/nul.jsonl holds nothing but NUL bytes (1,000 of them: "
                      "space preallocated for a write that never came, or a write cut short); there is nothing to "
                      "read"),
    "private without push": (["--private"], "error: --private applies to the repo --push-to-hub REPO_ID creates"),
    "other field": (["--dataset", "{bad}/other_field.jsonl"],
                    "error: --text-field 'text': {bad}/other_field.jsonl has no such column (its columns: body)"),
}
PROGRESS_BAR = re.compile(r"^[\w ]+: +\d+%\|")  # transformers' "Loading weights: 100%|███..."
SCRIPTS = {"continued_pretraining": [], "lora_finetune": ["--rank", "2"],
           "long_context": ["--rope-theta", "50000"]}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_bad_input_is_one_line_and_leaves_no_output_folder(env, tiny_model, bad_inputs, tmp_path, monkeypatch,
                                                           capsys, script, case):
    argv, expected = BAD_INPUTS[case]
    argv = [a.format(bad=bad_inputs) for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(tiny_model), *argv]
    monkeypatch.chdir(tmp_path)  # ./nope is relative
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main([*argv, "--output-dir", "runs/e1", "--steps", "2", *COMMON, *SCRIPTS[script]])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]
    assert len(err) == 1 and err[0].startswith(expected.format(bad=bad_inputs)), err
    assert not any(tmp_path.iterdir())  # no runs/e1, no runs/


def test_a_file_that_breaks_during_training_is_one_line_naming_it(env, tiny_model, bad_inputs, tmp_path, capsys):
    """A stream reads its second file only when the rows reach it, after the inputs were checked and steps were
    saved: the read error is still one line, naming that file, exit 2, and the saved checkpoint stays."""
    from gated_attention.training.streaming import CHUNK_DOCS

    first = tmp_path / "first.jsonl"  # the stream's first chunk of documents: a few steps' tokens
    first.write_text("".join(json.dumps({"text": "x"}) + "\n" for _ in range(CHUNK_DOCS)))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        import_example("continued_pretraining").main(
            ["--model", str(tiny_model), "--dataset", str(first), str(bad_inputs / "not_json.jsonl"), "--output-dir",
             str(out), "--steps", "20", "--save-every", "1", *COMMON])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if "error" in line.lower() or "Traceback" in line]  # not the progress bars
    assert len(errors) == 1 and err[-1] == errors[0], err
    assert errors[0].startswith(f"error: --dataset {first} {bad_inputs / 'not_json.jsonl'}: "
                                f"{bad_inputs / 'not_json.jsonl'} cannot be read (JSON parse error"), errors
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all((out / "checkpoints" / name / "step.json").exists() for name in saved), saved
    assert [r["step"] for r in read_log(out)] == list(range(1, len(saved) + 1))


@pytest.mark.parametrize("script", ["continued_pretraining", "lora_finetune"])
def test_seq_len_beyond_the_model_positions_is_refused_without_a_rope_change(env, tiny_model, tmp_path, capsys, script):
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main(["--model", str(tiny_model), "--output-dir", str(tmp_path / "out"),
                                      "--steps", "2", *COMMON, "--seq-len", "256"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --seq-len 256 is longer than {tiny_model}'s max_position_embeddings (64): it was never "
                   "trained at those positions. Use --seq-len 64 or less, or extend the context first "
                   "(examples/long_context.py, `gated-attention extend`)"], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_missing_model_from_the_command_line_is_one_line(env, tmp_path, script):
    """The command from the bug report, as a user runs it: exit 2, one line on stderr, no traceback, no runs/e1."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{script}.py"), "--model", "./nope", "--output-dir",
                           "runs/e1", "--steps", "2", *SCRIPTS[script]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: --model ./nope: no such folder"], proc.stderr
    assert not any(tmp_path.iterdir())


def test_tokenize_corpus_bad_input_is_one_line_and_leaves_nothing(env, tiny_model, bad_inputs, tmp_path, capsys):
    tokenize = import_example("tokenize_corpus")
    for argv, expected in (
        (["--model", str(tiny_model), "--dataset", str(bad_inputs / "empty.txt")],
         f"error: --dataset {bad_inputs / 'empty.txt'}: the file is empty"),
        *[(["--model", str(tiny_model), *[a.format(bad=bad_inputs) for a in BAD_INPUTS[case][0]]],
           BAD_INPUTS[case][1].format(bad=bad_inputs))
          for case in ("empty jsonl", "not JSON", "truncated JSON", "other field")],
        (["--model", str(tmp_path / "nope"), "--dataset", str(bad_inputs / "empty.txt")],
         f"error: --model {tmp_path / 'nope'}: no usable tokenizer"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            tokenize.main([*argv, "--output", str(tmp_path / "tok3")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expected), err
        assert not any(tmp_path.iterdir())  # neither tok3 nor a tok3.tmpPID folder

USAGE_ERRORS = [  # (script, arguments, what the one line must say)
    *[(script, ["--model", "m"], "error: the following arguments are required: --output-dir") for script in SCRIPTS],
    *[(script, ["--model", "m", "--output-dir", "o", "--steps", "0"], "error: argument --steps: ")
      for script in SCRIPTS],
    ("tokenize_corpus", ["--model", "m", "--dataset", "d.txt"], "error: the following arguments are required: --output"),
    ("tokenize_corpus", ["--model", "m", "--dataset", "d.txt", "--output", "o", "--shard-tokens", "0"],
     "error: argument --shard-tokens: "),
]


@pytest.mark.parametrize(("script", "argv", "expected"), USAGE_ERRORS)
def test_a_usage_error_is_one_line_too(env, tmp_path, monkeypatch, capsys, script, argv, expected):
    """argparse's own errors (a missing or out-of-range option) are one line as in `gated-attention`, not a usage block."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        import_example(script).main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and err[0].endswith("--help)"), err
    assert not any(tmp_path.iterdir())



FINISH_WORKER = """
import gc, json, sys
import torch, torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel
from gated_attention.training import finish_training

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
assert isinstance(model, DistributedDataParallel)
accelerator.backward(model(torch.randn(4, 8)).sum())
optimizer.step()

alive = []
destroy = dist.destroy_process_group
def checked_destroy(*args, **kwargs):
    gc.collect()
    alive.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
    return destroy(*args, **kwargs)
dist.destroy_process_group = checked_destroy

if sys.argv[2] == "finish":
    model = accelerator.unwrap_model(model)
    finish_training(accelerator)
else:
    accelerator.end_training()
open(f"{sys.argv[1]}.{accelerator.process_index}", "w").write(json.dumps(alive))
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["finish", "plain"])
def test_finish_training_frees_the_ddp_wrapper_before_the_process_group(env, tmp_path, ending):
    """A DDP wrapper outliving the process group can hang the process at exit (see `finish_training`)."""
    script = tmp_path / "worker.py"
    script.write_text(FINISH_WORKER)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script),
           str(tmp_path / "alive"), ending]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    alive = [json.loads((tmp_path / f"alive.{rank}").read_text()) for rank in (0, 1)]
    # accelerate's end_training alone destroys the group while its own list still holds the wrapper
    assert alive == ([[0], [0]] if ending == "finish" else [[1], [1]])


def test_gates_alone_the_logged_rates_and_the_evaluation_before_training(env, tmp_path, capfd):
    """`--train gates` moves the gates and nothing else; each step logs the learning rate it used (warmup over 2
    steps: half, then all of --gate-lr; --lr is NaN, as no other parameter trains); the validation rows are evaluated before training too; and a tied model's
    checkpoints are written without accelerate's "Removed shared tensor" note."""
    from safetensors.torch import load_file

    model = save_tiny_model(tmp_path / "tied", MAX_CHARS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            max_position_embeddings=64, tie_word_embeddings=True)
    out = tmp_path / "run"
    cpt = import_example("continued_pretraining")
    cpt.main(["--model", str(model), "--output-dir", str(out), "--steps", "2", "--warmup-steps", "2", "--save-every",
              "1", "--lr", "1e-3", "--gate-lr", "1e-2", "--train", "gates", *COMMON])
    printed = capfd.readouterr()
    assert "validation before training: loss" in printed.out
    assert "Removed shared tensor" not in printed.out + printed.err
    log = read_log(out)
    assert [r["gate_lr"] for r in log] == [5e-3, 1e-2]
    assert all(math.isnan(r["lr"]) for r in log)  # no other parameter trains
    before, after = load_file(model / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all("attn_gate" in name for name in changed)


def test_train_gates_on_a_model_without_gates_is_one_line(env, tmp_path, capsys):
    model = save_tiny_model(tmp_path / "ungated", MAX_CHARS, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, max_position_embeddings=64, attn_gate=None)
    cpt = import_example("continued_pretraining")
    capsys.readouterr()  # what saving the model printed
    with pytest.raises(SystemExit) as e:
        cpt.main(["--model", str(model), "--output-dir", str(tmp_path / "run"), "--steps", "1", "--train", "gates", *COMMON])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # progress bars aside
    assert len(errors) == 1 and errors[0].startswith("error: --train gates: ") and "has no attention gate" in errors[0]
    assert not (tmp_path / "run").exists()
