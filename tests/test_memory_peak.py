"""`--max-memory` is the most the whole process holds at its peak, measured: `convert` and `analyze` run as
processes of their own within the smallest budget they accept, and their peak resident memory (the kernel's
high-water mark, from `wait4`) stays within it.

The smallest budget is what the command's own refusal of a 1 MB budget adds up: the largest layer, the running
reserve and what the process holds when it checks. Near it the weights get almost no room, so what the process
adds after it measures itself (the first load's and forward's kernels, thread pools and allocator arenas; the
writers) decides whether the peak stays within.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gated_attention.cli_common import parse_size

REPO = Path(__file__).resolve().parents[1]
SIZE = r"(\d+(?:\.\d+)?) (KB|MB|GB)"
# What the refusal names besides the budget: the layer, the running reserve (when there is one), the process.
NEEDS = re.compile(rf"needs {SIZE} in \w+(?:, running the model {SIZE} more)?(?: and|,) this process holds {SIZE} already")
# Between two runs of the same command, what a process holds when it checks moves by a few hundred kB (more
# on a machine under load).
JITTER = 8 * 10**6


# Starts the command and says, last, its exit code and peak RSS (KiB on Linux). A process's peak counts the memory
# of the process it was forked from (the kernel keeps the larger high-water mark across exec): this small one,
# not pytest, which holds the models of the tests before.
LAUNCH = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(proc.pid, 0)
print(f"\\nexit {os.waitstatus_to_exitcode(status)} peak {usage.ru_maxrss * 1024}", flush=True)
"""


def _run(command: list[str]) -> tuple[int, int, str]:
    """Exit code, peak resident bytes and output of `python -m gated_attention COMMAND`, a process of its own."""
    proc = subprocess.run([sys.executable, "-c", LAUNCH, sys.executable, "-m", "gated_attention", *command], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True)  # fmt: skip
    out, last = proc.stdout.rstrip().rsplit("\n", 1)
    _, code, _, peak = last.split()
    return int(code), int(peak), out


def _smallest_budget(out: str) -> int:
    m = NEEDS.search(out)
    assert m, out
    sizes = [f"{m[i]}{m[i + 1]}" for i in range(1, len(m.groups()), 2) if m[i]]
    return sum(parse_size(size) for size in sizes)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A bf16 Llama of 10 MB whose largest layer is its 2 MB embedding, with a tokenizer for `analyze`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_analysis_capture import tiny_tokenizer

    folder = tmp_path_factory.mktemp("peak") / "llama"
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


COMMANDS = {
    "convert": lambda src, out: ["convert", str(src), str(out), "--dtype", "bfloat16"],
    "analyze": lambda src, out: ["analyze", str(src), "--out", str(out), "--device", "cpu", "--dtype", "bfloat16",
                                 "--n-per-domain", "1", "--max-length", "32", "--bootstrap", "10"],
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_the_peak_stays_within_the_smallest_budget_the_command_accepts(llama, tmp_path, command):
    code, _, out = _run([*COMMANDS[command](llama, tmp_path / "refused"), "--max-memory", "1MB"])
    assert code == 2 and "too small for one layer" in out, out
    budget = _smallest_budget(out) + JITTER
    code, peak, out = _run([*COMMANDS[command](llama, tmp_path / "out"), "--max-memory", f"{budget}B"])
    assert code == 0, out
    assert peak <= budget, f"peak {peak / 1e6:.2f} MB above --max-memory {budget / 1e6:.2f} MB:\n{out}"
