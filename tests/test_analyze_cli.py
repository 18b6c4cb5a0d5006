"""`gated-attention analyze` under bad input: inputs past the model's context, and a Hub that cannot be reached.

The Hub is made unreachable by pointing huggingface_hub at a closed local port (HF_ENDPOINT), so these
tests never touch the network and behave the same on a machine that has one.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gated_attention as ga
from gated_attention.cli import main
from gated_attention.cli_common import parse_size
from test_analysis_capture import TINY, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 16  # the tiny model's max_position_embeddings; the built-in samples are far longer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "tiny"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 2, "max_position_embeddings": CONTEXT})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _n_tokens(out: Path) -> list[int]:
    with open(out / "inputs.csv", newline="") as f:
        return [int(row["n_tokens"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("max_length", [None, 1000], ids=["default-128", "1000"])
def test_inputs_past_the_models_context_are_cut_there_with_a_warning(model_dir, tmp_path, capsys, max_length):
    out = tmp_path / "out"
    argv = ["analyze", str(model_dir), "--out", str(out), "--n-per-domain", "1", "--bootstrap", "10"]
    capsys.readouterr()
    assert main(argv + (["--max-length", str(max_length)] if max_length else [])) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("gated-attention analyze: warning: 3 of 3 inputs are longer than the model's context")
    assert f"max_position_embeddings {CONTEXT}" in warnings[0] and f"cut to {CONTEXT} tokens" in warnings[0]
    assert _n_tokens(out) == [CONTEXT] * 3


def test_inputs_within_the_context_get_no_warning(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["analyze", str(model_dir), "--out", str(out), "--n-per-domain", "1", "--bootstrap", "10",
                 "--max-length", "12"]) == 0  # fmt: skip
    assert "warning" not in capsys.readouterr().err
    assert _n_tokens(out) == [12] * 3


def _offline_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}  # port 9 (discard): refused


def _analyze(model: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gated_attention", "analyze", model, "--out", str(out), "--n-per-domain", "1",
         "--max-length", "12", "--bootstrap", "10"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_hub_id_that_is_not_cached_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    # huggingface_hub retries each file five times (1+2+4+8+8 s) when the Hub does not answer: 22 lines, a minute.
    proc = _analyze("someorg/not-cached", tmp_path / "out", _offline_env(tmp_path / "cache"))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gated-attention analyze: error: cannot load model 'someorg/not-cached'")
    assert "not in the Hugging Face cache" in err and "cannot be reached" in err
    assert not (tmp_path / "out").exists()


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(model_dir, tmp_path):
    # The cache layout huggingface_hub writes: refs/main names the snapshot, the snapshot holds the files.
    commit = "0" * 40
    repo = tmp_path / "cache" / "models--someorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    proc = _analyze("someorg/tiny", tmp_path / "out", _offline_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    assert "Retrying" not in proc.stderr
    assert _n_tokens(tmp_path / "out") == [12] * 3


def test_a_failed_analysis_leaves_no_empty_out_folder(tmp_path, capsys):
    # A one-position model: every input is cut to one token, which has no next token and no later query.
    folder = tmp_path / "model"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 1, "max_position_embeddings": 1})
    ga.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "new" / "out"
    capsys.readouterr()
    assert main(["analyze", str(folder), "--out", str(out), "--n-per-domain", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "gated-attention analyze: error: no input has at least two tokens"
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- several models, datasets, the output folder


def _analyze_main(*argv: str) -> int:
    return main(["analyze", *argv, "--max-length", "12", "--bootstrap", "10"])


def test_several_models_side_by_side(model_dir, tmp_path):
    other = tmp_path / "gated"
    config = ga.GatedDeltaNetHybridConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 3},
                                          layer_types=["linear_attention", "linear_attention", "full_attention"])
    ga.GatedDeltaNetHybridForCausalLM(config).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), str(other), "--out", str(out), "--n-per-domain", "1") == 0
    for name, layers in (("tiny", 2), ("gated", 3)):
        assert (out / name / "summary.md").is_file() and (out / name / "arrays.npz").is_file()
    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["folder"], int(r["layer"])) for r in rows] == [("tiny", l) for l in range(3)] + [("gated", l) for l in range(4)]
    assert [r["is_attention"] for r in rows if r["folder"] == "gated"] == ["False", "False", "False", "True"]
    # The CSV is what each model's own arrays say: the consensus sink's max activation, averaged over inputs.
    import numpy as np

    m_sink = np.load(out / "gated" / "arrays.npz")["m_sink"].mean(axis=0)
    assert [float(r["m_sink"]) for r in rows if r["folder"] == "gated"] == pytest.approx(m_sink.tolist(), rel=1e-12)
    assert (out / "comparison.png").stat().st_size > 0
    assert "[gated](gated/summary.md)" in (out / "summary.md").read_text()


def test_model_folders_named_like_the_comparisons_files_or_mathtext(model_dir, tmp_path):
    """A folder named `comparison.csv` would be where the comparison goes (IsADirectoryError), and one named
    `$\\notacommand$` is no mathtext for matplotlib's titles: the first is numbered, the second drawn as it is."""
    import shutil

    from gated_attention.analysis import compare
    from gated_attention.analysis.cli import COMPARISON_FILES

    assert COMPARISON_FILES == compare.FILES
    models = [tmp_path / "comparison.csv", tmp_path / "$\\notacommand$"]
    for folder in models:
        shutil.copytree(model_dir, folder)
    out = tmp_path / "out"
    assert _analyze_main(*map(str, models), "--out", str(out), "--n-per-domain", "1") == 0
    assert (out / "comparison.csv-2" / "summary.md").is_file() and (out / "$\\notacommand$" / "summary.md").is_file()
    assert (out / "comparison.csv").is_file() and (out / "comparison.png").stat().st_size > 0


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(model_dir, tmp_path, capsys):
    small = tmp_path / "small"
    ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**{**TINY, "vocab_size": 40, "num_hidden_layers": 1})).save_pretrained(small)
    capsys.readouterr()
    assert _analyze_main(str(small), "--tokenizer", str(model_dir), "--out", str(tmp_path / "out"), "--n-per-domain", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bar
    assert err.startswith("gated-attention analyze: error: MODEL ") and err.endswith(
        "the model's embedding has 40 rows: the tokenizer is not this model's (see --tokenizer)"), err
    assert not (tmp_path / "out").exists()


def _jsonl(path: Path, docs: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_dataset_inputs_stratified_by_a_domain_column(model_dir, tmp_path):
    import numpy as np

    docs = [{"body": f"text number {i} " * 5, "lang": ["en", "fr", "de"][i % 3]} for i in range(12)]
    docs.insert(2, {"body": "", "lang": "en"})  # no text: skipped, not counted
    data = _jsonl(tmp_path / "data.jsonl", docs)
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(out), "--dataset", str(data), "--text-field", "body",
                         "--domain-field", "lang", "--n-per-domain", "2") == 0  # fmt: skip
    arrays = np.load(out / "arrays.npz")
    assert arrays["domain"].tolist() == ["en", "fr", "de", "en", "fr", "de"]
    assert arrays["source"].tolist()[:3] == [f"{data}:0", f"{data}:1", f"{data}:3"]


def test_several_datasets_each_a_domain_with_its_own_text_field(model_dir, tmp_path):
    import numpy as np

    a = _jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i} " * 4} for i in range(5)])
    b = _jsonl(tmp_path / "b.jsonl", [{"question": f"what is {i} plus {i}?"} for i in range(5)])
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(out), "--dataset", str(a), "--dataset", str(b),
                         "--text-field", "text", "--text-field", "question", "--n-per-domain", "3") == 0  # fmt: skip
    assert np.load(out / "arrays.npz")["domain"].tolist() == [str(a)] * 3 + [str(b)] * 3


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ("", [], "is empty"),
        ("this is not json\n", [], "cannot be read"),
        ('{"text": "a whole line"}\n{"text": "cut', [], "cannot be read"),
        ('{"body": "some text"}\n', [], "--text-field 'text': "),
        ('{"text": "some text"}\n', ["--domain-field", "lang"], "--domain-field 'lang': "),
        ('{"text": "some", "lang": "en"}\n{"text": "more", "lang": null}\n', ["--domain-field", "lang"],
         "document 1 has no 'lang' value (null)"),
        ('{"text": "some text"}\n', ["--dataset", "DATA"], "is given twice with --text-field 'text'"),
    ],
    ids=["empty", "not-json", "truncated-json", "wrong-text-field", "wrong-domain-field", "null-domain", "given-twice"],
)
def test_a_dataset_that_cannot_be_read_is_one_line_and_writes_nothing(model_dir, tmp_path, capsys, content, flags, message):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    capsys.readouterr()
    flags = [str(data) if flag == "DATA" else flag for flag in flags]
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), "--dataset", str(data), *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gated-attention analyze: error: ") and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_one_file_with_two_text_fields_is_two_domains(model_dir, tmp_path):
    import numpy as np

    data = _jsonl(tmp_path / "qa.jsonl", [{"q": f"what is {i} plus {i}?", "a": f"it is {2 * i} exactly"} for i in range(3)])
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(out), "--dataset", str(data), "--dataset", str(data),
                         "--text-field", "q", "--text-field", "a", "--n-per-domain", "2") == 0  # fmt: skip
    assert np.load(out / "arrays.npz")["domain"].tolist() == [f"{data} [q]"] * 2 + [f"{data} [a]"] * 2


def test_split_of_a_dataset_saved_without_splits_is_refused(model_dir, tmp_path, capsys):
    """A dataset saved alone has no split to choose: --split validation would read it all, as if it were one."""
    from datasets import Dataset

    Dataset.from_dict({"text": ["some text here", "more text there"]}).save_to_disk(str(tmp_path / "saved"))
    argv = ["--dataset", str(tmp_path / "saved"), "--n-per-domain", "1"]
    capsys.readouterr()
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), *argv, "--split", "validation") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--split 'validation' names no split of it: it was saved as a dataset without splits; "
                        "leave --split out to read it"), err
    assert not (tmp_path / "out").exists()
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), *argv) == 0


def test_text_field_without_a_dataset_is_refused(model_dir, tmp_path, capsys):
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), "--text-field", "body") == 2
    assert "--text-field is for --dataset" in capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_replaces_an_earlier_analysis_whole(model_dir, tmp_path):
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "2", "--intervene", "deletion") == 0
    assert (out / "intervention.csv").is_file()
    assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "1") == 0
    assert not (out / "intervention.csv").exists()  # nothing of the earlier run is left beside the new files
    assert _n_tokens(out) == [12] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left beside it


def _intervention_rows(out: Path) -> list[dict]:
    with open(out / "intervention.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_an_intervention_at_chosen_layers_and_tokens(model_dir, tmp_path):
    """--intervene-layers and --intervene-tokens name residual positions X[l] (0: the embedding output, l: the output of
    decoder layer l) and token positions; their defaults, the inputs of the attention layers (X[0] and X[1] of the
    two attention layers) and the first token, give the same file as naming them."""
    runs = {"default": [], "named": ["--intervene-layers", "1", "0", "--intervene-tokens", "0"],
            "chosen": ["--intervene-layers", "2", "--intervene-tokens", "5", "3"]}
    for name, argv in runs.items():
        assert _analyze_main(str(model_dir), "--out", str(tmp_path / name), "--n-per-domain", "1",
                             "--intervene", "set-mean", *argv) == 0
    assert (tmp_path / "default" / "intervention.csv").read_bytes() == (tmp_path / "named" / "intervention.csv").read_bytes()
    default, chosen = _intervention_rows(tmp_path / "default"), _intervention_rows(tmp_path / "chosen")
    assert [(r["intervene_layers"], r["intervene_tokens"]) for r in default] == [("0 1", "0")] * 2
    assert [(r["intervene_layers"], r["intervene_tokens"]) for r in chosen] == [("2", "3 5")] * 2
    assert all(r["identity_exact_inputs"] == r["n_inputs"] == "3" for r in default + chosen)
    assert default[0]["perplexity"] == chosen[0]["perplexity"]  # the normal pass
    assert default[1]["perplexity"] != chosen[1]["perplexity"]
    summary = (tmp_path / "chosen" / "summary.md").read_text()
    assert "On token 3, 5 at X[l] for l = 2 (X[0] the embedding output, X[l] the output of decoder layer l)." in summary


@pytest.mark.parametrize("argv, expected", [
    (["--intervene-tokens", "1"], "--intervene-tokens is for --intervene, which is not given"),
    (["--intervene", "connection", "--intervene-layers", "1"],
     "--intervene-layers is for deletion and set-mean: connection holds the spike"),
    (["--intervene", "set-mean", "--intervene-layers", "1", "3"],
     "--intervene-layers 3: GatedAttentionForCausalLM's residual positions are 0 (the embedding output) to 2 (the "
     "output of decoder layer 2)"),
    (["--intervene", "deletion", "--intervene-tokens", "0", "12"],
     "--intervene-tokens 12: the shortest input has 12 tokens (positions 0 to 11)"),
    (["--intervene", "deletion", "--intervene-tokens", "-1"], "argument --intervene-tokens: expected an integer >= 0"),
], ids=["tokens-without-intervene", "connection-layers", "layer-past-the-last", "token-past-the-shortest", "negative"])
def test_an_intervention_where_the_model_or_inputs_have_no_state_is_one_line(model_dir, tmp_path, capsys, argv, expected):
    capsys.readouterr()
    try:
        code = _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), "--n-per-domain", "1", *argv)
    except SystemExit as e:  # argparse's usage error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gated-attention analyze: error: ") and expected in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_rerun_leaves_the_earlier_analysis_as_it_was(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "2") == 0
    before = _files(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # After every table of the new run is written, before its plots and summary.
    monkeypatch.setattr("gated_attention.analysis.plots.plot_all", interrupted)
    assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "1") == 130
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("inside", [True, False], ids=["inside-a-running-runs-out", "around-a-running-runs-out"])
def test_a_run_whose_out_holds_or_lies_in_a_running_runs_out_is_refused(model_dir, tmp_path, capsys, inside):
    """`analyze A B --out D/out` over an earlier analysis while `analyze C --out D/out/sub` ran: the first replaced
    D/out whole and the second's finished output was gone. Whichever starts second is refused while the other
    runs (here a sleeping process stands in for it, by its staging folder)."""
    earlier = tmp_path / "out"
    assert _analyze_main(str(model_dir), "--out", str(earlier), "--n-per-domain", "1") == 0
    before = _files(earlier)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if inside:  # the other run writes D/out/sub; this one asks for D/out
            running, out = earlier / f".sub.incomplete-{sleeper.pid}", earlier
        else:  # the other run writes D/out; this one asks for D/out/sub
            running, out = tmp_path / f".out.incomplete-{sleeper.pid}", earlier / "sub"
        running.mkdir()
        capsys.readouterr()
        assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "1") == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"gated-attention analyze: error: --out {out}: another run is writing an output "
                       f"{'inside' if inside else 'around'} it (process {sleeper.pid}, {running}); wait for it or "
                       "give another --out"), err
        assert running.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    running.rmdir()
    assert _files(earlier) == before


def test_a_second_run_into_the_same_out_is_refused(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = tmp_path / f".out.incomplete-{sleeper.pid}"  # what a run writing `out` right now has beside it
        running.mkdir()
        capsys.readouterr()
        assert _analyze_main(str(model_dir), "--out", str(out), "--n-per-domain", "1") == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"gated-attention analyze: error: --out {out} is being written by another run "
                       f"(process {sleeper.pid}, {running.name}); wait for it or give another --out")  # fmt: skip
        assert not out.exists() and running.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------- within a memory budget


def _arrays(folder: Path) -> dict:
    import numpy as np

    with np.load(folder / "arrays.npz") as arrays:
        return {key: arrays[key] for key in arrays.files}


def test_a_model_larger_than_its_budget_gives_the_same_numbers(tmp_path, capsys, weights_only_budget):
    """A budget smaller than the model: accelerate keeps what fits in memory and reads the other layers from the
    checkpoint's files as they run. Same inputs, same arithmetic on the same device: the same arrays, exactly."""
    import numpy as np

    from gated_attention.memory.budget import largest_layer

    folder = tmp_path / "model"
    config = ga.GatedDeltaNetHybridConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 4},
                                          layer_types=["linear_attention", "full_attention"] * 2)
    model = ga.GatedDeltaNetHybridForCausalLM(config)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = largest_layer(model)[1] + 1000
    assert budget < total / 2  # most of the model is read from disk
    argv = ["--n-per-domain", "1", "--intervene", "connection"]
    assert _analyze_main(str(folder), "--out", str(tmp_path / "whole"), *argv) == 0
    capsys.readouterr()
    assert _analyze_main(str(folder), "--out", str(tmp_path / "budget"), "--max-memory", str(budget), *argv) == 0
    assert "of weights read from the checkpoint as it runs" in capsys.readouterr().out
    whole, budgeted = _arrays(tmp_path / "whole"), _arrays(tmp_path / "budget")
    assert whole.keys() == budgeted.keys()
    for key in whole:
        np.testing.assert_array_equal(whole[key], budgeted[key], err_msg=key)
    with open(tmp_path / "whole" / "intervention.csv") as a, open(tmp_path / "budget" / "intervention.csv") as b:
        assert a.read() == b.read()
    assert [p.name for p in (tmp_path / "budget").iterdir() if p.name.startswith(".")] == []  # no offload folder left


def test_a_bf16_checkpoint_analysed_in_fp32_within_a_budget_casts_what_it_reads(tmp_path, capsys, weights_only_budget):
    """The default dtype (fp32) on a bf16 checkpoint, within a budget below the model: loaded in bf16, so that
    what stays on disk is not read while loading, and cast as it runs. bf16 -> fp32 is exact: the arrays equal
    those of the whole model in memory, and the weights in memory, in fp32, fit the budget."""
    import re

    import numpy as np
    import torch

    from gated_attention.cli_common import parse_size
    from gated_attention.memory.budget import largest_layer

    folder = tmp_path / "model"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 4})
    model = ga.GatedAttentionForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    budget = 4 * largest_layer(model)[1] + 2000  # two fp32 layers: accelerate's reserve for one, and one more
    argv = ["--n-per-domain", "1", "--bootstrap", "10"]
    assert _analyze_main(str(folder), "--out", str(tmp_path / "whole"), *argv) == 0
    capsys.readouterr()
    assert _analyze_main(str(folder), "--out", str(tmp_path / "budget"), "--max-memory", str(budget), *argv) == 0
    placed = re.search(r"([\d.]+ \w+) of ([\d.]+ \w+) of weights read from the checkpoint", capsys.readouterr().out)
    on_disk, total = (parse_size(size.replace(" ", "")) for size in placed.groups())
    # sizes printed to 3 digits: within 1%
    assert total == pytest.approx(2 * sum(p.numel() * p.element_size() for p in model.parameters()), rel=0.01)  # fp32
    assert 0 < total - on_disk <= budget * 1.01
    whole, budgeted = _arrays(tmp_path / "whole"), _arrays(tmp_path / "budget")
    for key in whole:
        np.testing.assert_array_equal(whole[key], budgeted[key], err_msg=key)


def test_an_fp32_checkpoint_analysed_in_bf16_within_a_budget_casts_as_transformers_does(tmp_path, capsys, monkeypatch,
                                                                                       weights_only_budget):
    """`--dtype bfloat16` on an fp32 checkpoint, within a budget below the model: loaded in fp32, so that what stays
    on disk is not read while loading, and cast as it runs. A narrowing cast is not exact, but it is transformers'
    own, tensor for tensor, with RoPE's inv_freq kept in float32: the arrays equal those of the whole model loaded
    in bf16 by transformers."""
    import numpy as np
    import torch

    from gated_attention.hub import loading
    from gated_attention.memory.budget import largest_layer

    folder = tmp_path / "model"
    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 4})
    model = ga.GatedAttentionForCausalLM(config)  # fp32
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    loads = []  # the dtype each load asks transformers for
    original = loading.from_pretrained_checked

    def recording(*args, **kwargs):
        loads.append(kwargs.get("dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(loading, "from_pretrained_checked", recording)
    budget = 3 * largest_layer(model.to(torch.bfloat16))[1] + 2000
    argv = ["--n-per-domain", "1", "--dtype", "bfloat16"]
    assert _analyze_main(str(folder), "--out", str(tmp_path / "whole"), *argv) == 0
    assert loads == [torch.bfloat16]  # all in memory: transformers casts as it loads
    capsys.readouterr()
    assert _analyze_main(str(folder), "--out", str(tmp_path / "budget"), "--max-memory", str(budget), *argv) == 0
    assert "of weights read from the checkpoint as it runs" in capsys.readouterr().out
    assert loads[-1] == torch.float32
    whole, budgeted = _arrays(tmp_path / "whole"), _arrays(tmp_path / "budget")
    assert whole.keys() == budgeted.keys()
    for key in whole:
        np.testing.assert_array_equal(whole[key], budgeted[key], err_msg=key)


def test_a_checkpoint_is_loaded_in_its_own_dtype_only_where_layers_stay_on_disk(weights_only_budget):
    import torch

    from gated_attention.memory.budget import loading_dtype
    from gated_attention.memory.budget import MemoryBudget

    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 2})
    with torch.device("meta"):
        skeleton = ga.GatedAttentionForCausalLM(config)  # fp32
    size = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    # All in memory: fp32 weights beside the bf16 bytes they are cast from, mapped from the file until the load ends.
    small, large = MemoryBudget(size, True), MemoryBudget(size * 3 // 2, True)
    assert loading_dtype(skeleton, {"dtype": "bfloat16"}, torch.float32, small) == torch.bfloat16
    assert loading_dtype(skeleton, {"dtype": "bfloat16"}, torch.float32, large) == torch.float32  # all in memory
    assert loading_dtype(skeleton, {"dtype": "float32"}, torch.float32, small) == torch.float32
    assert loading_dtype(skeleton, {}, torch.float32, small) == torch.float32  # the checkpoint's dtype unknown
    assert loading_dtype(skeleton, {"dtype": "bfloat16"}, "auto", small) == "auto"
    # Narrowing (an fp32 checkpoint run in bf16) goes the same way: the bf16 model beside the fp32 bytes, 3x its size.
    bf16 = MemoryBudget(size // 2, True), MemoryBudget(size * 3 // 2, True)  # size: the fp32 skeleton's bytes
    with torch.device("meta"):
        narrow = ga.GatedAttentionForCausalLM(config).to(torch.bfloat16)
    assert loading_dtype(narrow, {"dtype": "float32"}, torch.bfloat16, bf16[0]) == torch.float32
    assert loading_dtype(narrow, {"dtype": "float32"}, torch.bfloat16, bf16[1]) == torch.bfloat16  # all in memory


@pytest.mark.parametrize("argv, expected", [
    (["--device", "cuda"], "--device cuda: torch finds no cuda device on this machine; give --device cpu"),
    (["--device-map", "cuda:0"], "--device-map cuda:0: torch finds no cuda device on this machine; give --device cpu"),
    (["--device-map", "cpu", "--max-memory", "10KB"], "--device-map cpu holds all 1"),
], ids=["device-cuda", "device-map-cuda", "device-map-cpu-below-the-model"])
def test_a_placement_that_cannot_be_honoured_is_one_line_and_writes_nothing(model_dir, tmp_path, capsys, argv, expected):
    """Where CUDA is missing, accelerate would place the model on the CPU without a word; a model put whole on the
    CPU cannot stay within a budget below its size."""
    import torch

    if "cuda" in " ".join(argv) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    capsys.readouterr()
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gated-attention analyze: error: ") and expected in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_budget_too_small_for_one_layer_is_one_line_and_writes_nothing(model_dir, tmp_path, capsys):
    capsys.readouterr()
    assert _analyze_main(str(model_dir), "--out", str(tmp_path / "out"), "--max-memory", "1KB") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"gated-attention analyze: error: MODEL {model_dir}: --max-memory 1.00 KB is too small for one layer: ")
    assert err.endswith("give a larger --max-memory, a smaller --max-length, or free some memory; nothing was written")
    assert "this process holds" in err and "running the model" in err  # the budget bounds the whole process
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


SPLIT = re.compile(r"^--max-memory 2\.00 GB: ([\d.]+ [KMG]?B) this process, ([\d.]+ [KMG]?B) running reserve, "
                   r"([\d.]+ [KMG]?B) for weights$", re.MULTILINE)


def test_a_budgeted_run_says_how_its_budget_is_split_once_before_the_first_model_loads(model_dir, tmp_path, capsys):
    """--max-memory bounds the whole process; a run of two models says the split once, the first model's, before it
    loads (its placement line follows). The sizes are the process's own and the reserve for running the model."""
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    capsys.readouterr()
    assert _analyze_main(str(model_dir), str(other), "--out", str(tmp_path / "out"), "--n-per-domain", "1",
                         "--max-memory", "2GB") == 0
    out = capsys.readouterr().out
    splits = SPLIT.findall(out)
    assert len(splits) == 1, out
    assert out.index("--max-memory 2.00 GB:") < out.index("tiny: all ")  # before the first model's placement line
    held, reserve, weights = (parse_size(size.replace(" ", "")) for size in splits[0])
    assert held > 50_000_000 and reserve > 0  # Python and torch: tens of MB at least; running: eager attention's
    assert abs(held + reserve + weights - 2_000_000_000) <= 10_000_000  # the three make it, to two decimals of a GB


def test_the_help_says_the_budget_is_the_whole_process_and_its_split_is_printed(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the whole process may hold, Python, torch and the libraries included" in text
    assert "the split is printed once, at the start, before the model loads" in text


def test_the_help_says_how_the_intervention_layers_are_counted(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "X[0] is the embedding output, X[L] the output of decoder layer L (counted from 1" in text
    assert "(default: the inputs of the attention layers, X[f-1] for each attention layer f)" in text


def test_revision_reads_that_snapshot_of_a_cached_hub_id_offline(model_dir, tmp_path, cached_at_old_commit):
    """`--revision` picks the cache's snapshot of that commit; main's snapshot here holds no model at all."""
    old_commit = cached_at_old_commit(model_dir)

    argv = ["analyze", "someone/tiny", "--n-per-domain", "1", "--bootstrap", "10", "--max-length", "12"]
    assert main([*argv, "--out", str(tmp_path / "main")]) != 0
    assert main([*argv, "--revision", old_commit, "--out", str(tmp_path / "old")]) == 0
    assert _n_tokens(tmp_path / "old") == [12] * 3
