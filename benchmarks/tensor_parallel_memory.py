"""Parameter bytes per rank under tensor parallelism: each family against transformers' peer of the same shape.

    python benchmarks/tensor_parallel_memory.py [--tp 2]

Builds, in one run, each family of ours and the transformers model with the
same shape (float32, random weights): the dense model against Qwen3, the MoE
against Qwen3-MoE, the hybrid against Qwen3.5 (its Gated DeltaNet layers
included; Qwen3.5's full-attention layers carry the G1 elementwise gate inside
q_proj, so the G1 hybrid has exactly its parameters). Every model is loaded on
`--tp` CPU processes (gloo) with `DistributedConfig(tp_size=N)`, and rank 0's
local parameter bytes are counted (a sharded parameter as its local shard).

Prints, per pair: bytes per rank of ours and of the peer, their ratio (at most
1.00 for a model with the peer's parameters: sharding is real), and each one's
share of its whole model (ours may hold more bytes than the peer only where it
has more parameters, e.g. a gate, and then its share is what to compare).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, bounded

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=512)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
GDN = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
LAYERS = ["linear_attention", "full_attention"] * 2


def build(work: Path) -> list[tuple[str, str, Path, Path]]:
    """(family, our variant, our folder, peer folder) for every pair."""
    import torch
    from transformers import Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    import gated_attention as ga

    def save(model, name: str) -> Path:
        model.save_pretrained(work / name)
        return work / name

    torch.manual_seed(0)
    qwen3 = save(Qwen3ForCausalLM(Qwen3Config(**SHAPE)), "qwen3")
    qwen3_moe = save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, **MOE)), "qwen3_moe")
    qwen3_5 = save(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, **GDN, layer_types=LAYERS)), "qwen3_5")
    pairs = []
    for variant, gate in (("ungated", None), ("G1 elementwise", {}), ("G1 headwise", {"granularity": "headwise"}),
                          ("G1 head-shared", {"head_shared": True}), ("G2 elementwise", {"position": "G2"}),
                          ("G5 elementwise", {"position": "G5"})):
        config = ga.GatedAttentionConfig(**SHAPE, qk_norm=True, attn_gate=gate)
        pairs.append(("dense", variant, save(ga.GatedAttentionForCausalLM(config), f"dense-{variant}"), qwen3))
    for variant, gate in (("ungated", None), ("G1 elementwise", {})):
        config = ga.GatedAttentionMoeConfig(**SHAPE, **MOE, qk_norm=True, attn_gate=gate)
        pairs.append(("moe", variant, save(ga.GatedAttentionMoeForCausalLM(config), f"moe-{variant}"), qwen3_moe))
    for variant, gate in (("G1 elementwise", {}), ("G1 headwise", {"granularity": "headwise"})):
        config = ga.GatedDeltaNetHybridConfig(**SHAPE, **GDN, layer_types=LAYERS, qk_norm=True, attn_gate=gate)
        pairs.append(("hybrid", variant, save(ga.GatedDeltaNetHybridForCausalLM(config), f"hybrid-{variant}"), qwen3_5))
    return pairs


def worker(folders: list[str], out: str) -> None:
    """One rank: load each folder whole and sharded, count the bytes."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import gated_attention  # noqa: F401

    def nbytes(model) -> int:
        return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())

    world = int(os.environ["WORLD_SIZE"])
    counts = {}
    for folder in folders:
        whole = nbytes(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        sharded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       distributed_config=DistributedConfig(tp_size=world))
        counts[folder] = {"whole": whole, "rank": nbytes(sharded)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(counts))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=bounded(int, 1), default=2, help="ranks (CPU processes); default 2")
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs = build(work)
        folders = sorted({str(p) for pair in pairs for p in pair[2:]})
        out = work / "counts.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.tp),
               __file__, "--worker", str(out), *folders]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        counts = json.loads(out.read_text())

    print(f"tensor parallelism over {args.tp} CPU processes (gloo), transformers {transformers.__version__}, float32")
    print("| family | ours | peer | bytes per rank, ours | peer | ours / peer | share of the whole, ours | peer |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for family, variant, ours, peer in pairs:
        a, b = counts[str(ours)], counts[str(peer)]
        print(f"| {family} | {variant} | {peer.name} | {a['rank']:,} | {b['rank']:,} | {a['rank'] / b['rank']:.3f} "
              f"| {a['rank'] / a['whole']:.3f} | {b['rank'] / b['whole']:.3f} |")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[3:], sys.argv[2])
    else:
        sys.exit(main())
