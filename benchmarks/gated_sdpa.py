"""Speed of the fused gated-SDPA Triton kernel against its peers on one GPU, measured in one run.

For each sequence length and head dim (bf16, causal, GQA 4:1, elementwise G1 gate, B * T = 16k tokens,
HQ * D = 2048) it times, with triton.testing.do_bench (median):

    fused      gated_attention.kernels.gated_sdpa(..., backend="triton")
    sdpa+gate  torch SDPA on the flash backend, then a separate `out * sigmoid(gate)`
    fa2+gate   flash_attn_func, then the same multiply (only when flash-attn is installed)

and prints forward and forward+backward TFLOP/s (causal FLOPs: 2 * 2 * B * HQ * T^2 * D / 2 forward,
2.5x that backward) with the ratios fused / sdpa+gate. Targets (H100/H200): forward >= 1.0x,
forward+backward >= 0.9x, and >= 40 % of dense bf16 peak in the forward at 8k / hd128. A second table
times one decode step (T = 1) against a long cache: the fused split-KV path against SDPA + gate.

Before timing, each configuration checks the fused forward against sdpa+gate (max abs difference).
On a machine without a GPU the script says so and exits 0.

`--compile-only SM` (e.g. 90) needs no GPU: it compiles every kernel (bf16 and fp32, head dims 64/128,
causal or not, packed or not, each gate mode, the first GPU launch configs) for that compute capability
with triton's bundled ptxas, which catches errors in the compiled path that the interpreter cannot
(a few minutes per head dim on a CPU). Exits 1 if any kernel fails to compile.

Usage: python benchmarks/gated_sdpa.py [--seqlens 1024 2048 4096 8192 16384] [--head-dims 64 128]
       python benchmarks/gated_sdpa.py --compile-only 90 [--head-dims 128]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

DENSE_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.1}


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in name), None)


def make_inputs(B, T, S, HQ, HKV, D, requires_grad):
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)

    # [B, T, H, D] as the projections produce them; every path gets the same tensors
    return randn(B, T, HQ, D), randn(B, S, HKV, D), randn(B, S, HKV, D), randn(B, T, HQ, D)


def fused(q, k, v, gate):
    from gated_attention.kernels import gated_sdpa

    return gated_sdpa(q, k, v, gate, causal=True, backend="triton")


SDPA_NATIVE_GQA = True  # set in main(): whether the flash backend takes enable_gqa in this torch


def sdpa_then_gate(q, k, v, gate):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D] views, as transformers passes
    if not SDPA_NATIVE_GQA:  # expand k/v as transformers' repeat_kv does
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        causal = q.shape[2] == k.shape[2]  # a decode step (T = 1) sees the whole cache
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=SDPA_NATIVE_GQA)  # [B, HQ, T, D]
    return out.transpose(1, 2) * torch.sigmoid(gate)


def flash_attn_then_gate(q, k, v, gate):
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, causal=True) * torch.sigmoid(gate)


def bench(fn, inputs, grad_out=None) -> float:
    """Median milliseconds of fn (forward) or of forward + backward."""
    from triton.testing import do_bench

    if grad_out is None:
        with torch.no_grad():
            return do_bench(lambda: fn(*inputs))
    return do_bench(lambda: torch.autograd.backward(fn(*inputs), grad_out), grad_to_none=list(inputs))


def compile_only(sm: int, head_dims: list[int]) -> int:
    """Compile each kernel for compute capability `sm` without a GPU; returns the number of failures."""
    import itertools

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from gated_attention.kernels import gated_sdpa_triton as K

    def build(label, kernel, pointers, constants, config=None):
        fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an Autotuner wraps the JITFunction
        constants = {**constants, **(config.kwargs if config else {})}
        signature = {
            n: "constexpr" if n in constants else "*" + pointers[n] if n in pointers
            else "fp32" if n in ("qk_scale", "sm_scale") else "i32"
            for n in fn.arg_names
        }
        options = {"num_warps": config.num_warps if config else 4, "num_stages": config.num_stages if config else 1}
        try:
            compiled = triton_compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", sm, 32),
                                      options=options)
            print(f"ok    {label}  shared memory {compiled.metadata.shared} B", flush=True)
            return 0
        except Exception as error:  # noqa: BLE001 - report every kernel, then fail
            print(f"FAIL  {label}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
            return 1

    failures = 0
    dot_dtypes = {"bf16": tl.bfloat16, "fp32": tl.float32}
    cases = itertools.product(dot_dtypes, head_dims, (True, False), (False, True), (0, 1, 2))
    for dt, D, causal, varlen, gate in cases:
        common = dict(HEAD_DIM=D, IS_CAUSAL=causal, IS_VARLEN=varlen, GATE_MODE=gate, DOT=dot_dtypes[dt],
                      PRECISION="ieee" if dt == "fp32" else None)
        if not varlen:
            common["CU_SEQLENS"] = None
        label = f"{dt} D={D} causal={causal} varlen={varlen} gate={gate}"
        io = {"Q": dt, "K": dt, "V": dt, "G": dt, "O": dt, "OU": dt, "LSE": "fp32", "CU_SEQLENS": "i32"}
        failures += build(f"forward  {label}", K._fwd_kernel, io, {**common, "ACT": 0, "STORE_UNGATED": True},
                          K._FWD_CONFIGS[0])
        if gate == 0:  # the gate only enters the backward through dO_eff
            io = {"Q": dt, "K": dt, "V": dt, "DO": dt, "LSE": "fp32", "DELTA": "fp32", "DQ": dt, "DK": dt, "DV": dt,
                  "CU_SEQLENS": "i32"}
            failures += build(f"dq       {label}", K._bwd_dq_kernel, io, common, K._DQ_CONFIGS[0])
            failures += build(f"dk/dv    {label}", K._bwd_dkdv_kernel, io, common, K._DKDV_CONFIGS[0])
        if not varlen and causal:
            io = {"OU": dt, "DO": dt, "G": dt, "DO_EFF": dt, "DELTA": "fp32", "DG": dt}
            failures += build(f"bwd prep {dt} D={D} gate={gate}", K._bwd_preprocess_kernel, io,
                              dict(HEAD_DIM=D, GATE_MODE=gate, ACT=1, BLOCK_M=64))
            io = {"OP": "fp32", "LSEP": "fp32", "G": dt, "O": dt, "OU": dt, "LSE": "fp32"}
            failures += build(f"combine  {dt} D={D} gate={gate}", K._decode_combine_kernel, io,
                              dict(HEAD_DIM=D, GATE_MODE=gate, ACT=0, STORE_UNGATED=True, BLOCK_M=16))
        if not varlen and gate == 0:
            io = {"Q": dt, "K": dt, "V": dt, "OP": "fp32", "LSEP": "fp32"}
            failures += build(f"split    {dt} D={D} causal={causal}", K._decode_split_kernel, io,
                              dict(HEAD_DIM=D, IS_CAUSAL=causal, DOT=dot_dtypes[dt],
                                   PRECISION=common["PRECISION"], BLOCK_M=16, BLOCK_N=64))
    print(f"compile-only sm_{sm}: {failures} failure(s)")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384, help="B * T per configuration")
    parser.add_argument("--width", type=int, default=2048, help="HQ * D")
    parser.add_argument("--group", type=int, default=4, help="HQ / HKV")
    parser.add_argument("--decode-cache", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--compile-only", type=int, metavar="SM", help="compile the kernels for sm_SM, no GPU needed")
    args = parser.parse_args()

    if args.compile_only:
        return 1 if compile_only(args.compile_only, args.head_dims) else 0

    if not torch.cuda.is_available():
        print("gated_sdpa benchmark: no CUDA GPU on this machine; nothing to measure (the kernels need a GPU).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gated_sdpa benchmark: triton is not installed; nothing to measure.")
        return 0
    try:
        import flash_attn  # noqa: F401

        peers = {"sdpa+gate": sdpa_then_gate, "fa2+gate": flash_attn_then_gate}
    except ImportError:
        peers = {"sdpa+gate": sdpa_then_gate}

    global SDPA_NATIVE_GQA
    try:
        sdpa_then_gate(*make_inputs(1, 128, 128, 8, 2, 64, requires_grad=False))
    except RuntimeError:
        SDPA_NATIVE_GQA = False
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name)
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}; bf16, causal, GQA {args.group}:1, "
          f"elementwise sigmoid gate, B*T = {args.tokens}, HQ*D = {args.width}; peers: {', '.join(peers)}; "
          f"SDPA GQA: {'native' if SDPA_NATIVE_GQA else 'k/v expanded'}")
    header = (f"{'T':>6} {'D':>4} {'B':>3} | {'fwd TFLOP/s':>30} {'fused/sdpa':>10} {'%peak':>6} | "
              f"{'fwd+bwd TFLOP/s':>30} {'fused/sdpa':>10} | {'max|diff|':>9}")
    print(header)
    print("-" * len(header))
    names = ["fused", *peers]
    for D in args.head_dims:
        HQ = args.width // D
        HKV = HQ // args.group
        for T in args.seqlens:
            B = max(1, args.tokens // T)
            torch.manual_seed(0)
            inputs = make_inputs(B, T, T, HQ, HKV, D, requires_grad=True)
            grad_out = torch.randn_like(inputs[0])
            with torch.no_grad():
                diff = (fused(*inputs).float() - sdpa_then_gate(*inputs).float()).abs().max().item()
            flops_fwd = 2 * 2 * B * HQ * T * T * D / 2  # two matmuls, causal half
            fns = {"fused": fused, **peers}
            fwd = {n: flops_fwd / bench(fns[n], inputs) / 1e9 for n in names}  # ms -> TFLOP/s
            both = {n: 3.5 * flops_fwd / bench(fns[n], inputs, grad_out) / 1e9 for n in names}
            shown_fwd = " ".join(f"{n}={fwd[n]:.0f}" for n in names)
            shown_both = " ".join(f"{n}={both[n]:.0f}" for n in names)
            share = f"{100 * fwd['fused'] / peak:5.1f}%" if peak else "   n/a"
            print(f"{T:>6} {D:>4} {B:>3} | {shown_fwd:>30} {fwd['fused'] / fwd['sdpa+gate']:>9.2f}x {share:>6} | "
                  f"{shown_both:>30} {both['fused'] / both['sdpa+gate']:>9.2f}x | {diff:9.2e}")

    print("\ndecode step (T = 1, B = 1, no grad): microseconds")
    print(f"{'cache':>7} {'D':>4} | {'fused':>8} {'sdpa+gate':>10} {'sdpa/fused':>10} | {'max|diff|':>9}")
    for D in args.head_dims:
        HQ = args.width // D
        HKV = HQ // args.group
        for S in args.decode_cache:
            inputs = make_inputs(1, 1, S, HQ, HKV, D, requires_grad=False)
            with torch.no_grad():
                diff = (fused(*inputs).float() - sdpa_then_gate(*inputs).float()).abs().max().item()
            t_fused, t_sdpa = bench(fused, inputs) * 1e3, bench(sdpa_then_gate, inputs) * 1e3
            print(f"{S:>7} {D:>4} | {t_fused:>8.1f} {t_sdpa:>10.1f} {t_sdpa / t_fused:>9.2f}x | {diff:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
