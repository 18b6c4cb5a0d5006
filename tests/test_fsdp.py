"""FSDP2 with the gated model: on two CPU processes (gloo), and with the accelerate config on GPUs.

torch 2.13's FSDP2 (`fully_shard`) runs on CPU with gloo, so the first test shards
a tiny gated model per decoder layer, trains two steps on two processes and
compares the gathered weights with one process training on the same global
batch (FSDP2 averages the gradients over processes, which for equal local
batches is the global-batch mean; tolerance 1e-5 absolute for the order of the
float32 reductions).

`examples/configs/fsdp.yaml` itself cannot run on CPUs: accelerate 1.15 turns
FSDP on only for GPUs and other accelerators (`AcceleratorState` selects
`DistributedType.FSDP` only from MULTI_GPU/MULTI_XPU/...; two CPU processes are
MULTI_CPU, i.e. DDP, and the FSDP settings are ignored). The second test runs the
config through the example on the GPUs of a machine that has them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import gated_attention
    from gated_attention.training import make_optimizer

    out = sys.argv[1]
    torch.manual_seed(0)
    config = gated_attention.GatedAttentionConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, attn_gate={"position": "G1"})
    model = gated_attention.GatedAttentionForCausalLM(config)
    rows = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(1))  # the global batch [4, T]

    def train(model, batches):
        opt = make_optimizer(model, lr=1e-2, gate_lr=5e-2)
        for x in batches:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        return {g["name"]: g["lr"] for g in opt.param_groups}

    if len(sys.argv) > 2:  # one process, the whole batch
        train(model, [rows, rows])
        torch.save(model.state_dict(), out)
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.model.layers[0].self_attn.attn_gate.weight).__name__ == "DTensor"
        local = rows[rank * 2 : rank * 2 + 2]
        lrs = train(model, [local, local])
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, out)
            with open(out + ".json", "w") as f:
                json.dump(lrs, f)
        dist.barrier()
        dist.destroy_process_group()
        # The sharded model keeps the gloo group alive past destroy_process_group, and one of gloo's worker
        # threads may still be freeing a finished collective (it holds tensors) when the interpreter shuts
        # down: taking the GIL then aborts the process, "terminate called without an active exception"
        # (torch's decref during finalization, pytorch/pytorch#190489; 4 runs in 42 on a loaded 2-core
        # machine, with the barrier). Everything is written, so the worker leaves without the teardown.
        os._exit(0)
""")


def test_fsdp2_on_cpu_gloo_matches_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sharded, single = tmp_path / "fsdp.pt", tmp_path / "single.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(sharded)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = subprocess.run([sys.executable, str(script), str(single), "single"], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

    a, b = torch.load(sharded), torch.load(single)
    start = torch.load(single)  # (only for the names)
    assert a.keys() == b.keys() == start.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
    assert json.loads(Path(str(sharded) + ".json").read_text())["gate"] == 5e-2  # the gate group survived sharding


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate runs FSDP only on GPUs (a CPU run is DDP)")
def test_fsdp_config_on_gpus_resumes_a_stream(tmp_path):
    """examples/configs/fsdp.yaml on every GPU, a streamed jsonl corpus, sharded checkpoint, --resume latest."""
    from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM, data

    model = tmp_path / "tiny"
    tokenizer = data.load_tokenizer(300, max_chars=150_000, cache=tmp_path / "cache")
    config = GatedAttentionConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                                  attn_gate={"position": "G1"})
    GatedAttentionForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    text = "".join(d.text for d in data.corpus_split("train", 150_000))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": text[i : i + 300]}) + "\n" for i in range(0, len(text), 300)))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "examples"),
                                                                   os.environ.get("PYTHONPATH")) if p)}
    args = ["--model", str(model), "--dataset", str(corpus), "--seq-len", "32", "--batch-size", "2", "--steps", "4",
            "--save-every", "2", "--eval-sequences", "0", "--log-every", "1", "--no-progress"]

    def launch(out: Path, *extra: str) -> list[dict]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "examples" / "configs" / "fsdp.yaml"), "--num_processes", str(torch.cuda.device_count()),
               str(ROOT / "examples" / "continued_pretraining.py"), *args, "--output-dir", str(out), *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]

    first = launch(tmp_path / "first")
    assert any(p.name.startswith("pytorch_model_fsdp") for p in (tmp_path / "first/checkpoints/step-0000002").iterdir())
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    os.symlink(tmp_path / "first/checkpoints/step-0000002", resumed_dir / "checkpoints/step-0000002")
    resumed = launch(resumed_dir, "--resume", "latest")
    assert [r["batch"] for r in resumed] == [r["batch"] for r in first[2:]]
