"""Cost of the attention gate on the CPU, against transformers' Llama, measured in one run.

Three models of the same shape (default: 4 layers, hidden 512, T = 1024):
transformers `LlamaForCausalLM`, ours with the gate off, ours with the G1
elementwise gate. Runs are interleaved round-robin, so load from other
processes hits all three alike, and the fastest run of each is kept (on a
shared machine the minimum is the least noisy estimate of the cost itself). Prints forward and
forward+backward times and the ratios:

    gate off / transformers   target <= 1.02
    G1 / gate off             target <= 1.05  (the paper: under 2 % wall time on GPUs)

Usage: python benchmarks/gate_overhead.py [--layers 4 --hidden 512 --seq 1024 --repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.cli_common import OneLineErrorParser, bounded


def build(args):
    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape))
    off = GatedAttentionForCausalLM(GatedAttentionConfig(**shape, attn_gate=None))
    off.load_state_dict(llama.state_dict())
    g1 = GatedAttentionForCausalLM(GatedAttentionConfig(**shape, attn_gate={"position": "G1"}))
    return {"transformers Llama": llama, "ours, gate off": off, "ours, G1 elementwise": g1}


def time_once(model, ids, backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(ids)
    return time.perf_counter() - start


def main():
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=bounded(int, 1), default=4)
    parser.add_argument("--hidden", type=bounded(int, 1), default=512)
    parser.add_argument("--seq", type=bounded(int, 1), default=1024)
    parser.add_argument("--vocab", type=bounded(int, 1), default=32000)
    parser.add_argument("--repeats", type=bounded(int, 1), default=15)
    args = parser.parse_args()

    models = build(args)
    ids = torch.randint(0, args.vocab, (1, args.seq))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.layers} layers, hidden {args.hidden}, T={args.seq}, vocab {args.vocab}, fastest of {args.repeats}")
    results = {}
    for backward in (False, True):
        for model in models.values():
            time_once(model, ids, backward)  # warm-up
        samples = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                samples[name].append(time_once(model, ids, backward))
        results[backward] = {name: min(s) for name, s in samples.items()}

    names = list(models)
    print(f"{'model':<24}{'forward (s)':>14}{'fwd+bwd (s)':>14}")
    for name in names:
        print(f"{name:<24}{results[False][name]:>14.4f}{results[True][name]:>14.4f}")
    for label, num, den, target in (
        ("gate off / transformers", names[1], names[0], 1.02),
        ("G1 / gate off", names[2], names[1], 1.05),
    ):
        fwd = results[False][num] / results[False][den]
        both = results[True][num] / results[True][den]
        print(f"{label:<24} forward {fwd:.3f}x   fwd+bwd {both:.3f}x   (target <= {target})")


if __name__ == "__main__":
    main()
