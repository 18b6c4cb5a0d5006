"""Forward time of our torch `gated_delta_rule` against its peers on the CPU, in one run.

Peers: transformers' `torch_chunk_gated_delta_rule` (Qwen3.5's torch path) and
fla's naive chunk reference. Shapes: B=1, H=4, K=V=128, fp32, T in 1024 and 4096.
Each implementation runs once per round, interleaved, so background load hits
all of them alike; the time kept is the fastest round (the one least disturbed
by other processes on a shared machine). The printed ratios are ours / peer:
below 1.0 means ours is faster. Outputs are also compared, so a fast
wrong answer cannot pass unnoticed.

    python benchmarks/gdn_cpu.py [--repeats 7] [--threads N]
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.kernels.gated_delta_rule.chunk import torch_gated_delta_rule


def peers():
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5

    # transformers swaps in fla's Triton kernel whenever fla imports, and that kernel
    # fails on the CPU; __wrapped__ is transformers' own torch function.
    transformers_chunk = modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
    return {
        "transformers": lambda q, k, v, g, beta: transformers_chunk(q, k, v, g, beta)[0],
        "fla_naive_chunk": lambda q, k, v, g, beta: naive_chunk_gated_delta_rule(q, k, v, g, beta)[0],
    }


def inputs(T: int, B: int = 1, H: int = 4, D: int = 128):
    q = torch.randn(B, T, H, D)
    k = F.normalize(torch.randn(B, T, H, D), dim=-1)
    v = torch.randn(B, T, H, D)
    g = F.logsigmoid(torch.randn(B, T, H))
    beta = torch.rand(B, T, H)
    return q, k, v, g, beta


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=bounded(int, 1), default=7)
    parser.add_argument("--threads", type=bounded(int, 1), default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--lengths", type=bounded(int, 1), nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    impls = {"ours": lambda q, k, v, g, beta: torch_gated_delta_rule(q, k, v, g, beta)[0], **peers()}
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, B=1 H=4 D=128 fp32, repeats={args.repeats}")

    for T in args.lengths:
        x = inputs(T)
        times = {name: [] for name in impls}
        with torch.inference_mode():
            outs = {name: fn(*x) for name, fn in impls.items()}  # warm-up, and the outputs to compare
            for _ in range(args.repeats):
                for name, fn in impls.items():
                    start = time.perf_counter()
                    fn(*x)
                    times[name].append(time.perf_counter() - start)
        med = {name: min(t) for name, t in times.items()}
        print(f"T={T}: " + ", ".join(f"{name} {med[name] * 1e3:.1f} ms" for name in impls))
        for name in impls:
            if name == "ours":
                continue
            err = (outs["ours"] - outs[name]).abs().max().item()
            print(f"  ours / {name}: {med['ours'] / med[name]:.2f}   (max |diff| {err:.1e})")


if __name__ == "__main__":
    main()
