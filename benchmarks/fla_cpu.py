"""The linear-attention suite on a CPU: the torch mixers against their peers, and the hybrid's decode, in one run.

Part `mixers`: each torch path that `fla_torch_paths()` runs (gated_attention/fla_cpu) against fla's
token-by-token naive reference (`fla/ops/*/naive.py`; target: at least 5x faster at T = 512), against fla's
naive chunked or parallel form where fla has one (no target: those are already blocked matmuls), and against
transformers' torch chunk implementation where one exists (Gated DeltaNet: Qwen3.5's
`torch_chunk_gated_delta_rule`; KDA: Kimi Linear's `chunk_kimi_delta_attention`; target: at least 1.0x). Shapes
are the paper's 340M models: hidden 1024 with each fla layer's default heads, one sequence of T positions, fp32.

Part `decode`: the package's `GatedDeltaNetHybridForCausalLM` (the 340M GDN hybrid, 3:1, G1 gate) against
transformers' `Qwen3_5ForCausalLM` of the same shape and weights (`export.qwen3_5_config`) on its torch path,
one new token after a prompt, with the cache (target: at least 1.0x).

Part `analyze`: fla's own Gated DeltaNet hybrid of the paper's 340M shape (24 layers, hidden 1024, full attention
at every fourth layer: 3:1), built and run under `fla_torch_paths()`, over 12 inputs of 512 tokens: what
`gated-attention analyze` does per input (`analysis.analyze.capture_inputs`: eager attention maps, the residual
stream and the reductions, all inside hooks) against a plain forward of the same inputs (target: at most 1.3x).

Every implementation runs once per round, in an order shuffled every round, so background load and the cache
hit all alike; the time kept is the median over rounds. Ratios are peer time / ours: above 1.0 means ours is
faster. Outputs are compared too, so a fast wrong answer cannot pass unnoticed.

    python benchmarks/fla_cpu.py [--parts mixers decode analyze] [--repeats 5] [--length 512] [--threads N]
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gated_attention.cli_common import OneLineErrorParser, bounded

PARTS = ("mixers", "decode", "analyze")
NAIVE_TARGET, TRANSFORMERS_TARGET, DECODE_TARGET, CAPTURE_TARGET = 5.0, 1.0, 1.0, 1.3


def fla_naive(op: str, name: str) -> Callable:
    """A function of fla's `fla/ops/<op>/naive.py`, read from its file (plain torch; no fla import needed)."""
    path = os.path.join(os.path.dirname(importlib.util.find_spec("fla").origin), "ops", op, "naive.py")
    spec = importlib.util.spec_from_file_location(f"fla_{op}_naive_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def l2(x):
    return F.normalize(x, dim=-1)


MIXERS = ("gla", "retnet", "hgrn", "hgrn2", "delta_net", "gated_deltanet", "kda")


def mixer_cases(T: int, smoke: bool, mixers=MIXERS) -> list[tuple[str, str, dict[str, Callable], tuple[str, ...]]]:
    """(mixer, shape, {implementation: fn() -> output}, peers with a target) for each mixer."""
    from gated_attention.fla_cpu.delta_rule.chunk import torch_delta_rule
    from gated_attention.kernels.gated_delta_rule.chunk import torch_gated_delta_rule
    from gated_attention.fla_cpu.gla.chunk import torch_gla
    from gated_attention.fla_cpu.hgrn.chunk import torch_hgrn
    from gated_attention.fla_cpu.kda.chunk import torch_kda
    from gated_attention.fla_cpu.simple_gla.chunk import retention_decay, torch_retention

    hidden = 64 if smoke else 1024

    def heads(H, K, V):  # fla's default heads at hidden 1024; a sixteenth of each size for --smoke
        return (max(1, H // 4), max(8, K // 16), max(8, V // 16)) if smoke else (H, K, V)

    def qkv(H, K, V):
        return torch.randn(1, T, H, K), l2(torch.randn(1, T, H, K)), torch.randn(1, T, H, V)

    def gla():  # 4 heads, K = hidden / 2 / 4, V = hidden / 4; gates logsigmoid / 16 (gate_logit_normalizer)
        H, K, V = heads(4, 128, 256)
        q, k, v = qkv(H, K, V)
        g = F.logsigmoid(torch.randn(1, T, H, K)) / 16
        return ("gla", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_gla(q, k, v, g)[0],
            "fla naive recurrent": lambda: fla_naive("gla", "naive_recurrent_gla")(q, k, v, g)[0],
        }, ())

    def retnet():  # 8 heads, K = hidden / 8, V = 2 hidden / 8
        H, K, V = heads(8, 128, 256)
        q, k, v = qkv(H, K, V)
        decay = retention_decay(H).expand(1, T, H)
        return ("retnet", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_retention(q, k, v)[0],
            "fla naive recurrent": lambda: fla_naive("simple_gla", "naive_recurrent_simple_gla")(q, k, v, decay)[0],
            "fla naive parallel": lambda: fla_naive("retention", "naive_retention")(
                *(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2),
        }, ())

    def hgrn():  # one channel per hidden unit
        x, g = torch.randn(1, T, hidden), F.logsigmoid(torch.randn(1, T, hidden))
        return ("hgrn", f"D={hidden}", {
            "ours": lambda: torch_hgrn(x, g)[0],
            "fla naive recurrent": lambda: fla_naive("hgrn", "naive_recurrent_hgrn")(x, g)[0],
        }, ())

    def hgrn2():  # on the GLA op: hidden / 128 heads of K = 128 (expand_ratio), V = 128; undivided gates
        H, K, V = heads(8, 128, 128)
        q, v = torch.randn(1, T, H, K), torch.randn(1, T, H, V)
        g = F.logsigmoid(torch.randn(1, T, H, K))
        k = 1 - g.exp()
        return ("hgrn2", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_gla(q, k, v, g)[0],
            "fla naive recurrent": lambda: fla_naive("gla", "naive_recurrent_gla")(q, k, v, g)[0],
        }, ())

    def delta_net():  # 16 heads, K = V = hidden / 16
        H, K, V = heads(16, 64, 64)
        q, k, v = qkv(H, K, V)
        beta = torch.rand(1, T, H)
        return ("delta_net", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_delta_rule(q, k, v, beta)[0],
            "fla naive recurrent": lambda: fla_naive("delta_rule", "delta_rule_recurrence")(
                *(x.transpose(1, 2) for x in (q, k, v, beta)))[0].transpose(1, 2),
        }, ())

    def gated_deltanet():  # 6 heads of K = 256, V = 512 (fla's defaults)
        from transformers.models.qwen3_5 import modeling_qwen3_5

        # transformers swaps in fla's Triton kernel whenever fla imports; unwrapped is its own torch function
        qwen_chunk = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
        H, K, V = heads(6, 256, 512)
        q, k, v = qkv(H, K, V)
        g, beta = F.logsigmoid(torch.randn(1, T, H)), torch.rand(1, T, H)
        return ("gated_deltanet", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_gated_delta_rule(q, k, v, g, beta)[0],
            "fla naive recurrent": lambda: fla_naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")(
                q, k, v, beta, g)[0],
            "fla naive chunk": lambda: fla_naive("gated_delta_rule", "naive_chunk_gated_delta_rule")(
                q, k, v, g, beta)[0],
            "transformers (Qwen3.5)": lambda: qwen_chunk(q, k, v, g, beta)[0],
        }, ("transformers (Qwen3.5)",))

    def gated_deltanet_step():  # one decode step of the same layer, from a state
        from transformers.models.qwen3_5 import modeling_qwen3_5

        from gated_attention.kernels.gated_delta_rule.chunk import chunked_gated_delta_rule

        qwen_step = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
        H, K, V = heads(6, 256, 512)
        q, k, v = (x[:, :1] for x in qkv(H, K, V))
        g, beta, h0 = F.logsigmoid(torch.randn(1, 1, H)), torch.rand(1, 1, H), torch.randn(1, H, K, V)
        return ("gated_deltanet", "T=1, from a state", {
            "ours": lambda: torch_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)[0],
            "ours, a chunk of one (before)": lambda: chunked_gated_delta_rule(
                q, k, v, g, beta, K**-0.5, h0, True, False, 64)[0],
            "transformers (Qwen3.5) step": lambda: qwen_step(q, k, v, g, beta, initial_state=h0,
                                                             output_final_state=True)[0],
        }, ("transformers (Qwen3.5) step",))

    def kda():  # 16 heads of K = V = 128 (fla's defaults)
        H, K, V = heads(16, 128, 128)
        q, k, v = qkv(H, K, V)
        g, beta = F.logsigmoid(torch.randn(1, T, H, K)), torch.rand(1, T, H)
        peers = {}
        try:
            from transformers.models.kimi_linear import modeling_kimi_linear

            kimi_chunk = inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)
            peers["transformers (Kimi Linear)"] = lambda: kimi_chunk(q, k, v, g, beta)[0]
        except ImportError:  # a transformers release without Kimi Linear
            pass
        if T % 64 == 0:  # fla's naive chunked KDA takes whole chunks only
            peers["fla naive chunk"] = lambda: fla_naive("kda", "naive_chunk_kda")(q, k, v, g, beta)[0]
        return ("kda", f"H={H} K={K} V={V}", {
            "ours": lambda: torch_kda(q, k, v, g, beta)[0],
            "fla naive recurrent": lambda: fla_naive("kda", "naive_recurrent_kda")(q, k, v, g, beta)[0],
            **peers,
        }, tuple(name for name in peers if name.startswith("transformers")))

    builders = {"gla": [gla], "retnet": [retnet], "hgrn": [hgrn], "hgrn2": [hgrn2], "delta_net": [delta_net],
                "gated_deltanet": [gated_deltanet, gated_deltanet_step], "kda": [kda]}
    return [build() for name in mixers for build in builders[name]]


def interleaved_medians(fns: dict[str, Callable], repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each fn over `repeats` rounds, one call of each per round (after one untimed call),
    in an order shuffled every round (seeded): a memory-bound fn runs faster after one that left its inputs
    in the cache, and a fixed order would favour the same fn every round (HGRN: 1.9x in one order, 3x
    shuffled)."""
    outputs = {name: fn() for name, fn in fns.items()}  # warm-up, and the outputs to compare
    times = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def part_mixers(args) -> list[str]:
    print(f"\nmixers: one sequence of T={args.length}, fp32, median of {args.repeats} interleaved rounds; "
          "speed-up = peer time / ours")
    print(f"{'mixer':<15} {'shape':<18} {'peer':<27} {'ours ms':>8} {'peer ms':>9} {'speed-up':>8} {'target':>7}"
          f"  max|diff|")
    missed = []
    with torch.inference_mode():
        for mixer, shape, fns, targeted in mixer_cases(args.length, args.smoke, args.mixers):
            torch.manual_seed(0)
            medians, outputs = interleaved_medians(fns, args.repeats)
            for peer in fns:
                if peer == "ours":
                    continue
                ratio = medians[peer] / medians["ours"]
                target = NAIVE_TARGET if peer == "fla naive recurrent" else TRANSFORMERS_TARGET if peer in targeted else None
                err = (outputs["ours"].float() - outputs[peer].float()).abs().max().item()
                mark = "" if target is None else f">={target:.0f}x" if ratio >= target else f"MISSED {target:.0f}x"
                if target is not None and ratio < target:
                    missed.append(f"{mixer} vs {peer}")
                print(f"{mixer:<15} {shape:<18} {peer:<27} {medians['ours'] * 1e3:8.1f} {medians[peer] * 1e3:9.1f} "
                      f"{ratio:7.2f}x {mark:>7}  {err:.1e}")
    return missed


def part_decode(args) -> list[str]:
    from transformers import Qwen3_5ForCausalLM

    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM
    from gated_attention.convert.export import export_checkpoint, qwen3_5_torch_path

    overrides = {"attn_gate": {"position": "sdpa"}, "qk_norm": True}  # as Qwen3.5: G1 gate, q/k norms
    if args.smoke:
        config = GatedDeltaNetHybridConfig(hybrid_ratio="3:1", hidden_size=64, intermediate_size=96,
                                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                           head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16,
                                           linear_value_head_dim=16, vocab_size=97, **overrides)
    else:
        config = GatedDeltaNetHybridConfig.from_preset("gdn-340m-3to1", **overrides)
    torch.manual_seed(0)
    ours = GatedDeltaNetHybridForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:  # the same weights, through the exporter's exact mapping
        ours.save_pretrained(Path(tmp) / "ours")
        export_checkpoint(str(Path(tmp) / "ours"), Path(tmp) / "qwen3_5", verify=False, log=lambda *a, **k: None)
        native = Qwen3_5ForCausalLM.from_pretrained(Path(tmp) / "qwen3_5").eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    steps = args.decode_steps
    print(f"\ndecode: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.layer_types.count('full_attention')} full attention; a {args.prompt}-token prompt, then "
          f"{steps} single-token steps with the cache, median step of {args.repeats} interleaved rounds")

    def decoder(model, context=contextlib.nullcontext):
        def run():
            with context():
                out = model(prompt, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    times.append(time.perf_counter() - start)
                    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return statistics.median(times), out.logits
        return run

    runs = {
        "ours": decoder(ours),
        "ours, a chunk of one (before)": decoder(ours, chunk_of_one),
        "transformers Qwen3.5": decoder(native),
    }
    step_times = {name: [] for name in runs}
    logits = {}
    with torch.inference_mode(), qwen3_5_torch_path():
        for _ in range(args.repeats):
            for name, run in runs.items():
                step, logits[name] = run()
                step_times[name].append(step)
    medians = {name: statistics.median(t) for name, t in step_times.items()}
    peer = medians["transformers Qwen3.5"]
    print(f"one decode step: transformers Qwen3.5 {peer * 1e3:.2f} ms")
    missed = []
    for name in ("ours", "ours, a chunk of one (before)"):
        ratio = peer / medians[name]
        err = (logits[name] - logits["transformers Qwen3.5"]).abs().max().item()
        mark = "" if name != "ours" else f">={DECODE_TARGET:.0f}x" if ratio >= DECODE_TARGET else f"MISSED {DECODE_TARGET:.0f}x"
        print(f"  {name:<31} {medians[name] * 1e3:8.2f} ms, speed-up {ratio:.2f}x {mark}  (last logits max|diff| {err:.1e})")
        if mark.startswith("MISSED"):
            missed.append("decode vs transformers Qwen3.5")
    return missed


def part_analyze(args) -> list[str]:
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from gated_attention.analysis.analyze import capture_inputs
    from gated_attention.analysis.samples import Sample
    from gated_attention.fla_cpu import fla_torch_paths

    if args.smoke:
        shape = dict(hidden_size=64, num_hidden_layers=4, num_heads=2, head_dim=16, vocab_size=97)
        attn, n_inputs, T = {"layers": [3], "num_heads": 4}, 2, 16
    else:  # fla's defaults for the mixer's heads (6 x 256), attention heads 16 x 64
        shape = dict(hidden_size=1024, num_hidden_layers=24, vocab_size=32000)
        attn, n_inputs, T = {"layers": list(range(3, 24, 4)), "num_heads": 16}, args.analyze_inputs, args.length
    torch.manual_seed(0)
    with fla_torch_paths():
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**shape, attn=attn)).eval()
    g = torch.Generator().manual_seed(2)
    inputs = [(Sample("random", f"ids:{i}", ""), torch.randint(0, shape["vocab_size"], (1, T), generator=g))
              for i in range(n_inputs)]
    print(f"\nanalyze: fla's Gated DeltaNet hybrid, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"full attention at layers {[i + 1 for i in attn['layers']]} (1-based); {n_inputs} inputs of {T} tokens, "
          f"median of {args.analyze_repeats} interleaved rounds after one untimed round")

    def plain():
        with fla_torch_paths():
            for _, ids in inputs:
                model(input_ids=ids, use_cache=False)

    def analyze():
        capture_inputs(model, inputs, torch.device("cpu"))

    with torch.inference_mode():
        medians, _ = interleaved_medians({"plain forward": plain, "analyze": analyze}, args.analyze_repeats)
    ratio = medians["analyze"] / medians["plain forward"]
    mark = f"<={CAPTURE_TARGET}x" if ratio <= CAPTURE_TARGET else f"MISSED {CAPTURE_TARGET}x"
    print(f"  plain forward {medians['plain forward']:.1f} s, analyze {medians['analyze']:.1f} s: "
          f"capture overhead {ratio:.2f}x {mark}")
    return [] if ratio <= CAPTURE_TARGET else ["analyze vs a plain forward"]


@contextlib.contextmanager
def chunk_of_one():
    """The gated delta rule as it was before the recurrent step: a single position runs as a chunk of one."""
    module = sys.modules["gated_attention.kernels.gated_delta_rule.chunk"]
    plain = module.torch_gated_delta_rule

    def chunk_path(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                   use_qk_l2norm_in_kernel=False, chunk_size=64):
        if q.shape[1] != 1 or cu_seqlens is not None:
            return plain(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
        return module.chunked_gated_delta_rule(q, k, v, g, beta, scale or k.shape[-1] ** -0.5, initial_state,
                                               output_final_state, use_qk_l2norm_in_kernel, chunk_size)

    module.torch_gated_delta_rule = chunk_path
    try:
        yield
    finally:
        module.torch_gated_delta_rule = plain


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--mixers", nargs="+", choices=MIXERS, default=list(MIXERS), help="which mixers (part mixers)")
    parser.add_argument("--repeats", type=bounded(int, 1), default=5)
    parser.add_argument("--length", type=bounded(int, 1), default=512, help="positions per sequence (mixers)")
    parser.add_argument("--prompt", type=bounded(int, 1), default=64, help="prompt tokens before decoding")
    parser.add_argument("--decode-steps", type=bounded(int, 1), default=8, help="timed decode steps per round")
    parser.add_argument("--threads", type=bounded(int, 1), default=None,
                        help="torch threads (default: the cores the load average leaves free, as training does)")
    parser.add_argument("--analyze-inputs", type=bounded(int, 1), default=12, help="inputs of --length tokens (analyze)")
    parser.add_argument("--analyze-repeats", type=bounded(int, 1), default=2, help="timed rounds (analyze)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: check that the script runs, not speed")
    args = parser.parse_args(argv)

    import warnings

    from transformers.utils import logging as transformers_logging

    from gated_attention.training.threads import set_cpu_threads

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # fla's "Triton is not supported on current platform", deprecations
    threads, why = set_cpu_threads(args.threads)
    print(f"torch {torch.__version__}, {threads} thread(s) ({why}), {os.cpu_count()} CPUs")
    missed = []
    if "mixers" in args.parts:
        missed += part_mixers(args)
    if "decode" in args.parts:
        missed += part_decode(args)
    if "analyze" in args.parts:
        missed += part_analyze(args)
    print(f"\ntargets missed: {', '.join(missed)}" if missed else "\nevery target met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
