"""One rank of a tensor-parallel check; run by `torchrun --nproc_per_node N tests/tp_worker.py CASES OUT`.

CASES is a JSON list of `{"name", "path", "mode", "roundtrip", "bytes_only"}` checkpoint folders.
For each, every rank loads the folder twice: once whole (the reference, what one
process computes) and once sharded as `mode` says, then compares on the same
batch: logits (no grad: transformers' local inference path), the loss and
every parameter's gradient (with grad: its DTensor training path; a sharded
gradient is gathered), and 16 greedy tokens with the cache. With `roundtrip`,
the sharded model is saved and rank 0 loads the result in one process; with
`bytes_only`, only the parameter bytes are counted (a peer whose forward cannot
run on a CPU: transformers' Qwen3.5 picks fla's GPU kernels wherever fla imports).
Rank 0 writes `{name: result}` to OUT; an exception at any step is the
case's `error` (its first line), so one failure does not hide the others.

`mode`: `tp` (`DistributedConfig(tp_size=N)`, the default), `auto` (`tp_plan="auto"`),
`tp_ep` (`tp_size=N, ep_size=N`), `fsdp_ep` (`fsdp_size=N, ep_size=N`), `ep_legacy` (`tp_size=N,
enable_expert_parallel=True`: transformers 5.17's expert parallelism).
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import gated_attention  # noqa: F401  (registers the model types and the plan's own style)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load(path: str, mode: str | None, world: int):
    if mode is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if mode == "auto":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    sizes = {"tp": dict(tp_size=world), "tp_ep": dict(tp_size=world, ep_size=world),
             "fsdp_ep": dict(fsdp_size=world, ep_size=world),
             "ep_legacy": dict(tp_size=world, enable_expert_parallel=True)}[mode]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes))


def measure(model, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        logits = local(model(input_ids=ids).logits)
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                min_new_tokens=16, pad_token_id=0)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: local(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "tokens": local(tokens), "loss": local(loss).detach(), "grads": grads}


def compare(ref: dict, got: dict) -> dict:
    worst_name, worst = None, 0.0
    for name, g in ref["grads"].items():
        other = got["grads"].get(name)
        if other is None:
            return {"error": f"no gradient for {name} in the sharded model"}
        rel = ((other - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        if rel >= worst:
            worst_name, worst = name, rel
    return {
        "logits": (got["logits"] - ref["logits"]).abs().max().item(),
        "tokens": bool(torch.equal(got["tokens"], ref["tokens"])),
        "loss": abs(got["loss"].item() - ref["loss"].item()),
        "grad": worst,
        "grad_worst": worst_name,
        "grads": len(ref["grads"]),
    }


def local_parameter_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def run_case(case: dict, world: int, rank: int) -> dict:
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    whole = load(case["path"], None, world)
    model = load(case["path"], case.get("mode", "tp"), world)
    result = {} if case.get("bytes_only") else compare(measure(whole, ids), measure(model, ids))
    result["parameter_bytes"], result["whole_parameter_bytes"] = local_parameter_bytes(model), local_parameter_bytes(whole)
    if case.get("roundtrip"):
        folder = tempfile.mkdtemp(prefix="tp-roundtrip-") if rank == 0 else None
        shared = [folder]
        dist.broadcast_object_list(shared, src=0)
        model.save_pretrained(shared[0])
        dist.barrier()
        if rank == 0:
            with torch.no_grad():
                again = AutoModelForCausalLM.from_pretrained(shared[0], dtype=torch.float32)(input_ids=ids).logits
                before = whole(input_ids=ids).logits
            result["roundtrip"] = (again - before).abs().max().item()
        dist.barrier()
    return result


def main(cases_path: str, out_path: str) -> None:
    import os

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for case in json.loads(open(cases_path).read()):
        try:
            results[case["name"]] = run_case(case, world, rank)
        except Exception as error:  # recorded per case; the test reads it
            results[case["name"]] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
