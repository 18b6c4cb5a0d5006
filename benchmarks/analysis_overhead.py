"""Cost of `Capture` (residual stream + attention maps + gate scores) against a plain eager forward.

One model (default: our G1-gated dense model, 4 layers, hidden 512, T = 512,
eager attention, which is what attention maps need anyway), three ways, in one run:

    plain       model(ids) with attn_implementation="eager"
    capture     `with Capture(model): model(ids)`: hooks installed and removed per call,
                residual states, attention maps and gate scores kept
    reduced     what `gated-attention analyze` runs: `Capture(model, reduce=True)`, each map,
                state and gate reduced inside its hook as the layer runs, then the per-input
                reduction (token max |X|, consensus sink, first-token attention)

Runs are interleaved round-robin so load from other processes hits all alike;
the fastest of each is kept (on a shared machine the least noisy estimate).
Prints the ratios; target: capture / plain <= 1.3.

Usage: python benchmarks/analysis_overhead.py [--layers 4 --hidden 512 --seq 512 --repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.analysis.analyze import reduce_record
from gated_attention.analysis.capture import Capture
from gated_attention.cli_common import OneLineErrorParser, bounded


def build(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GatedAttentionConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
        attn_gate={"position": "G1"},
    )
    return GatedAttentionForCausalLM(config).eval().to(args.device)


@torch.no_grad()
def plain(model, ids) -> None:
    model(input_ids=ids, use_cache=False)


@torch.no_grad()
def capture(model, ids) -> None:
    with Capture(model):
        model(input_ids=ids, use_cache=False)


@torch.no_grad()
def capture_reduced(model, ids) -> None:
    with Capture(model, reduce=True) as cap:
        model(input_ids=ids, use_cache=False)
    reduce_record(cap.records[-1], cap.layout)


def time_once(fn, model, ids) -> float:
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(model, ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=bounded(int, 1), default=4)
    parser.add_argument("--hidden", type=bounded(int, 1), default=512)
    parser.add_argument("--seq", type=bounded(int, 1), default=512)
    parser.add_argument("--vocab", type=bounded(int, 1), default=32000)
    parser.add_argument("--repeats", type=bounded(int, 1), default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    model = build(args)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, args.vocab, (1, args.seq), device=args.device)
    runs = {"plain eager forward": plain, "capture": capture, "capture, reduced": capture_reduced}
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; {args.layers} layers, "
        f"hidden {args.hidden}, T={args.seq}, fastest of {args.repeats}"
    )
    for fn in runs.values():
        time_once(fn, model, ids)  # warm-up
    samples = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            samples[name].append(time_once(fn, model, ids))
    best = {name: min(s) for name, s in samples.items()}
    for name, seconds in best.items():
        print(f"{name:<22}{seconds:>10.4f} s")
    base = best["plain eager forward"]
    print(f"capture / plain           {best['capture'] / base:.3f}x   (target <= 1.3)")
    print(f"reduced / plain           {best['capture, reduced'] / base:.3f}x   (what analyze runs)")


if __name__ == "__main__":
    main()
