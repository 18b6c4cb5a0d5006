"""The README's Python blocks that run on a CPU, run as written.

"Use" builds, saves and reloads a model, and the "Analyze" line that follows it
reads that folder; "Scale out" runs under `torchrun` with two gloo processes on
a tiny converted Llama in the folder name it uses. vLLM's and mlx-lm's blocks
need those engines: `benchmarks/serving_check.py` runs those routes
(`tests/test_serving.py` where an engine is configured).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from convert_helpers import make_source
from gated_attention.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def python_block(first_line: str) -> str:
    """The README's ```python block that starts with `first_line`."""
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", README, flags=re.M | re.S) if b.startswith(first_line)]
    assert len(blocks) == 1, f"README has {len(blocks)} python blocks starting {first_line!r}"
    return blocks[0]


def test_use_block_and_the_analyze_line_after_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(python_block("import gated_attention"), "README.md (Use)", "exec"), names)
    model, tokenizer = names["model"], names["tokenizer"]  # as reloaded through the Auto classes
    assert type(model).__name__ == "GatedAttentionForCausalLM" and model.config.attn_gate["position"] == "sdpa"
    assert "auto_map" in (tmp_path / "my-gated-model" / "config.json").read_text()
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))

    line = next(line for line in README.splitlines() if line.startswith("gated-attention analyze ./my-gated-model"))
    argv = shlex.split(line, comments=True)[1:]
    assert main(argv) == 0
    assert (tmp_path / "analysis" / "summary.md").is_file()


def test_scale_out_block_under_torchrun(tmp_path):
    """Two gloo ranks: the same greedy tokens on both, and the checkpoint they save is the model, whole."""
    # 4 heads, 2 kv heads: they split over 2 ranks; so does the vocabulary, as transformers 5.17 needs for lm_head
    make_source("llama", tmp_path / "src", vocab_size=96)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "llama-gated"), "--no-verify"]) == 0
    (tmp_path / "tp.py").write_text(python_block("# torchrun --nproc_per_node 2 tp.py"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "tp.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # One print per rank into the same pipe: the two may share a line, so they are found, not split by line.
    printed = [re.sub(r"\s+", "", p) for p in re.findall(r"tensor\(\[\[[\d,\s]+\]\]\)", proc.stdout)]
    assert len(printed) == 2 and printed[0] == printed[1], proc.stdout  # the same tokens on both ranks
    assert printed[0].startswith("tensor([[1,2,3,4,") and printed[0].count(",") == 19, printed  # 4 + 16 new

    def weights(folder: str) -> dict:
        return {k: v for f in sorted((tmp_path / folder).glob("*.safetensors")) for k, v in load_file(f).items()}

    source, saved = weights("llama-gated"), weights("llama-gated-again")
    assert saved.keys() == source.keys()
    for name, tensor in source.items():  # loaded in bf16, so saved in bf16: the source's weights rounded
        assert saved[name].shape == tensor.shape and torch.equal(saved[name], tensor.to(torch.bfloat16)), name
