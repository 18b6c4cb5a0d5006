"""The `gated-attention` command starts light: `--help`, `--version` and a command line that is wrong on
its face import neither torch nor transformers, and the help says what is true.

Each case runs a fresh interpreter with `-X importtime`, which lists every module the process
imported on stderr, so the check sees exactly what a user's command loads. No timings are
asserted here; `benchmarks/startup.py` measures them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gated_attention

HEAVY = ("torch", "transformers", "numpy", "safetensors", "huggingface_hub")
COMMANDS = ["", "convert", "extend", "export", "analyze", "quickstart", "stream"]


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` output ("import time: self | cumulative | name")."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def run_help(argv_prefix: list[str], command: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-X", "importtime", *argv_prefix, *([command] if command else []), "--help"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c or "top-level")
def test_help_imports_no_torch_or_transformers(command):
    proc = run_help(["-m", "gated_attention"], command)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: gated-attention" in proc.stdout
    modules = imported_modules(proc.stderr)
    assert "gated_attention.cli" in modules  # the listing is real: it shows our own modules
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"`gated-attention {command} --help` imported {heavy[:5]}"


def test_console_script_help_imports_no_torch(tmp_path):
    # The script pip writes for `[project.scripts] gated-attention = "gated_attention.cli:main"`.
    script = tmp_path / "gated-attention"
    script.write_text(
        "import re\nimport sys\nfrom gated_attention.cli import main\nif __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n"
    )
    proc = run_help([str(script)], "convert")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: gated-attention convert" in proc.stdout
    modules = imported_modules(proc.stderr)
    assert not sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers"))


def test_a_plain_import_registers_the_auto_classes():
    # This process imported gated_attention as any program does (not as the command), so it registered.
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for model_type, config_name, model_name in [
        ("gated_attention", "GatedAttentionConfig", "GatedAttentionForCausalLM"),
        ("gated_attention_moe", "GatedAttentionMoeConfig", "GatedAttentionMoeForCausalLM"),
        ("gated_deltanet_hybrid", "GatedDeltaNetHybridConfig", "GatedDeltaNetHybridForCausalLM"),
    ]:
        config = AutoConfig.for_model(model_type)
        assert type(config) is getattr(gated_attention, config_name)
        assert AutoModelForCausalLM._model_mapping[type(config)] is getattr(gated_attention, model_name)
        assert AutoModel._model_mapping[type(config)].__name__ == model_name.replace("ForCausalLM", "Model")


def test_public_names_resolve_and_unknown_names_raise():
    for name in gated_attention.__all__:
        assert getattr(gated_attention, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        gated_attention.no_such_name  # noqa: B018


def test_analyze_parser_lists_the_interventions_the_analysis_knows():
    from gated_attention.analysis.cli import INTERVENTIONS
    from gated_attention.analysis.interventions import KINDS

    assert INTERVENTIONS == KINDS


def test_a_command_that_runs_registers_the_auto_classes(tmp_path):
    # Started as the command, the package registers nothing at import; `main` registers before the command
    # runs. `extend` reads a gated checkpoint's config through AutoConfig, so it fails without that.
    from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM

    config = GatedAttentionConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32)
    GatedAttentionForCausalLM(config).save_pretrained(tmp_path / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "gated_attention", "extend", str(tmp_path / "src"), str(tmp_path / "dst"),
         "--rope-theta", "20000", "--no-verify"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "dst" / "config.json").exists()


def test_a_module_run_with_m_that_imports_the_package_gets_the_registration(tmp_path):
    """Only `python -m gated_attention` skips the registration; `python -m mypkg.train` whose package
    imports gated_attention (sys.argv[0] is "-m" then too) must find the Auto classes registered."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("import gated_attention\n")
    (package / "train.py").write_text(
        "from transformers import AutoConfig\n"
        "print(type(AutoConfig.for_model('gated_attention')).__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "mypkg.train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "GatedAttentionConfig"


# --- answers that come before any heavy import ------------------------------------------------------------

LIGHT_FORBIDDEN = ("torch", "transformers", "numpy", "safetensors")


def run_command(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gated_attention", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, "\n".join(lines)), imported_modules(proc.stderr)


def test_version_names_the_package_and_its_libraries_without_importing_them(tmp_path):
    import huggingface_hub
    import torch
    import transformers

    proc, modules = run_command(["--version"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"gated-attention {gated_attention.__version__} (transformers {transformers.__version__}, "
                           f"torch {torch.__version__}, huggingface_hub {huggingface_hub.__version__})\n")  # fmt: skip
    assert not sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], "the following arguments are required: COMMAND"),
        (["convert"], "the following arguments are required: SRC, DST"),
        (["convert", "src", "out", "--gate", "rowwise"], "argument --gate: invalid choice: 'rowwise'"),
    ],
    ids=["no-command", "convert-no-args", "bad-choice"],
)
def test_a_usage_error_is_one_line_that_points_to_help(tmp_path, argv, expected):
    proc, _ = run_command(argv, tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert expected in proc.stderr and proc.stderr.endswith("--help)")


# Each: a command line that is wrong on its face, and what the one line says. SRC `src` is a folder with a
# config.json, `existing` a folder, `afile` a file (see `workdir`); nothing is read before the answer.
REFUSED_BEFORE_IMPORTS = {
    "extend-nothing-to-do": (["extend", "src", "out"], "nothing to do: give --rope-theta"),
    "shard-size-not-a-size": (["convert", "src", "out", "--max-shard-size", "abc"], "argument --max-shard-size: expected a size such as 5GB"),
    "shard-size-zero": (["convert", "src", "out", "--max-shard-size", "0GB"], "argument --max-shard-size: expected a size above zero"),
    "max-memory-not-a-size": (["convert", "src", "out", "--max-memory", "lots"], "argument --max-memory: expected a size such as 4GB"),
    "max-memory-zero": (["export", "src", "out", "--format", "qwen3_5", "--max-memory", "0GB"], "argument --max-memory: expected a size above zero"),
    "max-memory-above-ram": (["extend", "src", "out", "--rope-theta", "2e4", "--max-memory", "1000TB"], "more than this machine's memory"),
    "max-memory-400-digits": (["analyze", "src", "--out", "o", "--max-memory", "9" * 400], "(400 characters) is more than this machine's memory"),
    "shard-size-400-digits": (["convert", "src", "out", "--max-shard-size", "9" * 400 + "GB"], "argument --max-shard-size: expected a size such as 5GB or 500MB, got '99999999999999999999'... (too large)"),
    "src-missing": (["convert", "./nope", "out"], "SRC ./nope: no such folder"),
    "src-no-repo-id": (["export", "org//name", "out", "--format", "qwen3_5"], "SRC org//name: no such folder"),
    "src-a-file": (["convert", "afile", "out"], "SRC afile is a file"),
    "src-empty": (["convert", "", "x"], "SRC is empty: give a checkpoint folder or a Hub repo id"),
    "analyze-model-empty": (["analyze", "", "--out", "o"], "MODEL is empty"),
    "revision-of-a-folder": (["convert", "src", "out", "--revision", "v1"], "--revision is for a Hub repo id"),
    "dst-exists": (["extend", "src", "existing", "--rope-theta", "1e6"], "DST existing already exists; pass --overwrite"),
    "dst-dot": (["convert", "src", ".", "--overwrite"], "must name a folder to create"),
    "dst-inside-src": (["convert", "src", "src/out"], "must not be SRC, inside SRC or contain it"),
    "yarn-without-original": (["convert", "src", "out", "--yarn-factor", "4"], "--yarn-factor needs --original-max-position-embeddings"),
    "yarn-below-one": (["extend", "src", "out", "--yarn-factor", "0.5", "--original-max-position-embeddings", "64"], "--yarn-factor must be a number > 1"),
    "yarn-fractional-positions": (["convert", "src", "out", "--yarn-factor", "1.3", "--original-max-position-embeddings", "7"], "is not a whole number of positions"),
    "original-alone": (["convert", "src", "out", "--original-max-position-embeddings", "64"], "only used with --yarn-factor"),
    "theta-negative": (["convert", "src", "out", "--rope-theta", "-1"], "--rope-theta must be a positive number"),
    "theta-nan": (["extend", "src", "out", "--rope-theta", "nan"], "--rope-theta must be a positive number"),
    "export-no-format": (["export", "src", "out"], "the following arguments are required: --format"),
    "analyze-model-missing": (["analyze", "./nope", "--out", "o"], "model folder not found: ./nope"),
    "analyze-tokenizer-missing": (["analyze", "src", "--out", "o", "--tokenizer", "./nope"], "--tokenizer folder not found"),
    "analyze-out-a-file": (["analyze", "src", "--out", "afile"], "argument --out: afile exists and is not a folder"),
    "analyze-max-length": (["analyze", "src", "--out", "o", "--max-length", "1"], "argument --max-length: expected an integer >= 2"),
    "analyze-n-per-domain": (["analyze", "src", "--out", "o", "--n-per-domain", "0"], "argument --n-per-domain: expected an integer >= 1"),
    "analyze-bootstrap": (["analyze", "src", "--out", "o", "--bootstrap", "0"], "argument --bootstrap: expected an integer >= 1"),
    "analyze-max-memory": (["analyze", "src", "--out", "o", "--max-memory", "lots"], "argument --max-memory: expected a size such as 4GB"),
    "analyze-device-map": (["analyze", "src", "--out", "o", "--device-map", "everywhere"], "argument --device-map: expected auto, balanced"),
    "analyze-device-and-map": (["analyze", "src", "--out", "o", "--device", "cpu", "--device-map", "auto"], "not allowed with argument --device"),
    "analyze-text-file-and-dataset": (["analyze", "src", "--out", "o", "--text-file", "afile", "--dataset", "x.jsonl"], "not allowed with argument"),
    "analyze-text-file": (["analyze", "src", "--out", "o", "--text-file", "none.txt"], "argument --text-file: none.txt: no such file"),
    "analyze-device": (["analyze", "src", "--out", "o", "--device", "gpu"], "argument --device: expected auto, cpu, cuda"),
    "stream-sinks-fill-the-window": (["stream", "src", "--text-file", "afile", "--window", "4", "--sink-tokens", "4", "--out", "o"], "--sink-tokens 4 must be below --window 4"),
    "stream-model-missing": (["stream", "./nope", "--text-file", "afile", "--window", "8", "--out", "o"], "model folder not found: ./nope"),
    "analyze-revision-of-a-folder": (["analyze", "src", "--out", "o", "--revision", "v1"], "--revision is for a Hub repo id, and MODEL src is a local folder"),
    "stream-revision-of-a-folder": (["stream", "src", "--text-file", "afile", "--window", "8", "--out", "o", "--revision", "v1"], "--revision is for a Hub repo id, and MODEL src is a local folder"),
    "convert-private-alone": (["convert", "src", "out", "--private"], "--private applies to the repo --push-to-hub REPO_ID creates"),
    "quantize-bad-repo-id": (["quantize", "src", "out", "--scheme", "W8A8", "--push-to-hub", "a/b/c"], "--push-to-hub a/b/c: "),
    "stream-out-working-folder": (["stream", "src", "--text-file", "afile", "--window", "8", "--out", "."], "--out . is the working folder"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "src").mkdir()
    (folder / "src" / "config.json").write_text("{}")
    (folder / "existing").mkdir()
    (folder / "afile").write_text("x")
    return folder


@pytest.mark.parametrize("case", sorted(REFUSED_BEFORE_IMPORTS))
def test_a_wrong_command_line_is_refused_before_torch_is_imported(workdir, case):
    """On a busy machine importing torch and transformers takes tens of seconds: no reason to wait for them."""
    argv, expected = REFUSED_BEFORE_IMPORTS[case]
    proc, modules = run_command(argv, workdir)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"gated-attention {argv[0]}: error: ") and expected in proc.stderr, proc.stderr
    heavy = sorted(m for m in modules if m.split(".")[0] in LIGHT_FORBIDDEN)
    assert not heavy, f"imported {heavy[:5]} before refusing"
    assert sorted(p.name for p in workdir.iterdir()) == ["afile", "existing", "src"]  # nothing written


@pytest.mark.parametrize("command", ["", "convert", "extend", "export", "analyze", "stream"], ids=lambda c: c or "top-level")
def test_help_states_each_default_once_and_no_default_that_is_not_there(command):
    """`(default: None)` on a required option, or two defaults for one option, is help that is not true."""
    proc = run_help(["-m", "gated_attention"], command)
    options = re.split(r"\n  (?=-)", proc.stdout.split("options:", 1)[1])  # one block per option
    for block in options:
        text = " ".join(block.split())
        assert "default: None" not in text and "(default: False)" not in text, text
        assert text.count("default") <= 1, text
