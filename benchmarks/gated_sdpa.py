"""Speed of the fused gated-SDPA Triton kernel against every peer a user could run instead, in one run.

For each sequence length T and head dim D (bf16, causal, GQA 4:1 by default, elementwise sigmoid gate,
B * T = 16k tokens, HQ * D = 2048), on the same tensors:

    fused         gated_attention.kernels.gated_sdpa(..., backend="triton"): the gate in the kernel's epilogue
    sdpa          torch's default SDPA dispatch, i.e. what attn_implementation="sdpa" runs (the backend it
                  picks is printed), then `out * sigmoid(gate)`
    cudnn, flash, efficient
                  each SDPA backend forced with `sdpa_kernel`, then the gate; native GQA (enable_gqa) where the
                  backend takes it, else k/v expanded as transformers' repeat_kv does (inside the timed call);
                  a backend that refuses the shape is skipped with its reason printed
    fa2, fa3      flash_attn.flash_attn_func / flash_attn_interface.flash_attn_func, then the gate, where
                  importable

Each row prints one path's forward and forward+backward TFLOP/s (triton.testing.do_bench, median; causal
FLOPs: 2 * 2 * B * HQ * T^2 * D / 2 forward, 2.5x that backward) and the ratio fused / that path, plus
max|path - fused| of the forward output. A summary per (T, D) gives fused against the best peer, the
figure the kernel's speed goals were stated in (forward >= 1.05x, forward+backward >= 1.0x, >= 55 % of dense bf16
peak in the forward at 16k / hd128). A second table times one decode step (T = 1, B = 1) against caches
of 4k-64k, in microseconds. `--csv PATH` also writes every row as a table.

The fused kernels autotune here (GATED_ATTENTION_TRITON_AUTOTUNE is not set to 0); the configs the
autotuner chose per key are printed at the end.

On a machine without CUDA the script prints "no CUDA: skipped" and exits 0. `--smoke` instead runs the
whole script tiny on the CPU (fused = the torch reference there), so that code rot shows without a GPU.

`--compile-only SM` (e.g. 90) needs no GPU: it compiles every kernel (bf16 and fp32, head dims 64/128,
causal or not, packed or not, each gate mode, the first launch config) for that compute capability with
triton's bundled ptxas, which catches errors in the compiled path that the interpreter cannot.
`--all-configs` adds every autotune config of the forward, dq and dk/dv kernels (bf16, causal, not
packed), printing each one's shared memory. Exits 1 if any kernel fails to compile.

Usage: python benchmarks/gated_sdpa.py [--seqlens 1024 2048 4096 8192 16384] [--head-dims 64 128] [--csv F]
       python benchmarks/gated_sdpa.py --smoke
       python benchmarks/gated_sdpa.py --compile-only 90 [--all-configs] [--head-dims 128]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch
import torch.nn.functional as F

from gated_attention.cli_common import OneLineErrorParser, bounded

DENSE_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.1}


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in name), None)


def make_inputs(B, T, S, HQ, HKV, D, device, dtype, requires_grad):
    """q, gate [B, T, HQ, D] and k, v [B, S, HKV, D], as the projections produce them."""

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=requires_grad)

    return randn(B, T, HQ, D), randn(B, S, HKV, D), randn(B, S, HKV, D), randn(B, T, HQ, D)


# --- the paths ------------------------------------------------------------------------------------------


def fused(q, k, v, gate):
    from gated_attention.kernels import gated_sdpa

    backend = "triton" if q.is_cuda else "auto"  # --smoke: the torch reference on the CPU
    return gated_sdpa(q, k, v, gate, causal=True, backend=backend)


def sdpa_path(backend, native_gqa: bool):
    """torch SDPA (default dispatch when backend is None, else that backend alone), then the gate."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, gate):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D] views, as transformers
        if not native_gqa:  # k/v expanded to [B, HQ, S, D], as transformers' repeat_kv does
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        causal = q.shape[2] == k.shape[2]  # a decode step (T = 1) sees the whole cache
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=native_gqa)
        else:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=native_gqa)
        return out.transpose(1, 2) * torch.sigmoid(gate)  # [B, T, HQ, D]

    return run


def flash_attn_path(module_name: str):
    module = __import__(module_name, fromlist=["flash_attn_func"])

    def run(q, k, v, gate):
        out = module.flash_attn_func(q, k, v, causal=q.shape[1] == k.shape[1])
        out = out[0] if isinstance(out, tuple) else out  # some FA3 builds also return the log-sum-exp
        return out * torch.sigmoid(gate)

    return run


def default_sdpa_backend(q, k, v, native_gqa: bool) -> str:
    """The SDPA backend torch's default dispatch picks for these [B, T, H, D] tensors."""
    from torch.nn.attention import SDPBackend

    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if not native_gqa:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, q.shape[2] == k.shape[2], enable_gqa=native_gqa)
        return SDPBackend(choice).name.lower()
    except Exception as error:  # noqa: BLE001 - a private API: report, do not fail the benchmark
        return f"unknown ({type(error).__name__})"


def peers(sample, smoke: bool) -> tuple[dict, list[str]]:
    """The runnable peers for tensors like `sample` ({name: fn}) and one line per peer that was skipped."""
    from torch.nn.attention import SDPBackend

    found, skipped = {}, []

    def runs(fn) -> str | None:
        try:
            with torch.no_grad():
                fn(*sample)
            return None
        except Exception as error:  # noqa: BLE001 - a backend that refuses the shape raises RuntimeError
            return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"

    backends = {"sdpa": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in backends.items():
        reasons = []
        for native in (True, False):
            fn = sdpa_path(backend, native)
            reason = runs(fn)
            if reason is None:
                label = name if native else f"{name}(kv expanded)"
                if backend is None:
                    label += f" [{default_sdpa_backend(*sample[:3], native)}]"
                found[label] = fn
                break
            reasons.append(reason)
        else:
            skipped.append(f"{name}: {reasons[-1]}")
    for name, module in (("fa2", "flash_attn"), ("fa3", "flash_attn_interface")):
        if smoke:
            continue
        try:
            fn = flash_attn_path(module)
        except ImportError as error:
            skipped.append(f"{name}: {module} does not import ({error})")
            continue
        reason = runs(fn)
        if reason is None:
            found[name] = fn
        else:
            skipped.append(f"{name}: {reason}")
    return found, skipped


# --- timing ---------------------------------------------------------------------------------------------


def time_ms(fn, inputs, grad_out=None) -> float:
    """Median milliseconds of fn (forward, no grad) or of forward + backward."""
    if grad_out is None:
        def step():
            with torch.no_grad():
                fn(*inputs)
    else:
        def step():
            torch.autograd.backward(fn(*inputs), grad_out)
    step()  # compiles and autotunes outside the timed region
    if inputs[0].is_cuda:
        from triton.testing import do_bench

        return do_bench(step, warmup=10, rep=50, grad_to_none=list(inputs), return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        for x in inputs:
            x.grad = None
    return sorted(times)[1]


# --- compile-only ---------------------------------------------------------------------------------------


def compile_only(sm: int, head_dims: list[int], all_configs: bool) -> int:
    """Compile each kernel for compute capability `sm` without a GPU; returns the number of failures."""
    import itertools

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from gated_attention.kernels.gated_sdpa import triton as K

    def build(label, kernel, pointers, constants, config=None):
        fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an Autotuner wraps the JITFunction
        constants = {**constants, **(config.kwargs if config else {})}
        signature = {
            n: "constexpr" if n in constants else "*" + pointers[n] if n in pointers
            else "fp32" if n in ("qk_scale", "sm_scale") else "i32"
            for n in fn.arg_names
        }
        options = {"num_warps": config.num_warps if config else 4, "num_stages": config.num_stages if config else 1}
        if config:
            tile = f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']}"
            label += f"  [{tile} w{config.num_warps} s{config.num_stages}]"
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
    def fwd_io(dt):
        return {"Q": dt, "K": dt, "V": dt, "G": dt, "O": dt, "OU": dt, "LSE": "fp32", "CU_SEQLENS": "i32"}

    def bwd_io(dt):
        return {"Q": dt, "K": dt, "V": dt, "DO": dt, "LSE": "fp32", "DELTA": "fp32", "DQ": dt, "DK": dt, "DV": dt,
                "CU_SEQLENS": "i32"}

    cases = itertools.product(dot_dtypes, head_dims, (True, False), (False, True), (0, 1, 2))
    for dt, D, causal, varlen, gate in cases:
        common = dict(HEAD_DIM=D, IS_CAUSAL=causal, IS_VARLEN=varlen, GATE_MODE=gate, DOT=dot_dtypes[dt],
                      PRECISION="ieee" if dt == "fp32" else None)
        if not varlen:
            common["CU_SEQLENS"] = None
        label = f"{dt} D={D} causal={causal} varlen={varlen} gate={gate}"
        failures += build(f"forward  {label}", K.fwd_kernel, fwd_io(dt), {**common, "ACT": 0, "STORE_UNGATED": True},
                          K.FWD_CONFIGS[0])
        if gate == 0:  # the gate only enters the backward through dO_eff
            failures += build(f"dq       {label}", K.bwd_dq_kernel, bwd_io(dt), common, K.DQ_CONFIGS[0])
            failures += build(f"dk/dv    {label}", K.bwd_dkdv_kernel, bwd_io(dt), common, K.DKDV_CONFIGS[0])
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
    if all_configs:  # the autotune lists, for the training shapes: bf16, causal, not packed
        for D in head_dims:
            common = dict(HEAD_DIM=D, IS_CAUSAL=True, IS_VARLEN=False, DOT=tl.bfloat16, PRECISION=None,
                          CU_SEQLENS=None)
            for config in K.FWD_CONFIGS[1:]:
                failures += build(f"forward  bf16 D={D} gate=1", K.fwd_kernel, fwd_io("bf16"),
                                  {**common, "GATE_MODE": 1, "ACT": 0, "STORE_UNGATED": True}, config)
            for config in K.DQ_CONFIGS[1:]:
                failures += build(f"dq       bf16 D={D}", K.bwd_dq_kernel, bwd_io("bf16"), {**common, "GATE_MODE": 1},
                                  config)
            for config in K.DKDV_CONFIGS[1:]:
                failures += build(f"dk/dv    bf16 D={D}", K.bwd_dkdv_kernel, bwd_io("bf16"),
                                  {**common, "GATE_MODE": 1}, config)
    print(f"compile-only sm_{sm}: {failures} failure(s)")
    return failures


# --- the benchmark --------------------------------------------------------------------------------------


def autotuned_configs() -> list[str]:
    """One line per (kernel, autotune key) with the config the autotuner chose."""
    from gated_attention.kernels.gated_sdpa import triton as K

    lines = []
    for name in ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel"):
        kernel = getattr(K, name)
        for key, config in getattr(kernel, "cache", {}).items():
            shown = f"BLOCK_M={config.kwargs['BLOCK_M']} BLOCK_N={config.kwargs['BLOCK_N']} " \
                    f"num_warps={config.num_warps} num_stages={config.num_stages}"
            lines.append(f"{name:>17} key={key}: {shown}")
    return lines


CSV_FIELDS = ("kind", "T", "S", "D", "B", "path", "fwd_tflops", "fwd_bwd_tflops", "fused_over_path_fwd",
              "fused_over_path_fwd_bwd", "microseconds", "path_over_fused", "max_abs_diff")


def csv_writer(path: str | None):
    """A function writing one row to `path` at once (a run stopped by a time limit keeps its rows)."""
    if path is None:
        return lambda row: None
    f = open(path, "w", newline="")  # noqa: SIM115 - open for the whole run, flushed per row
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    writer.writeheader()

    def write(row):
        writer.writerow(row)
        f.flush()

    return write


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=bounded(int, 1), nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=bounded(int, 1), nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=bounded(int, 1), default=16384, help="B * T per configuration")
    parser.add_argument("--width", type=bounded(int, 1), default=2048, help="HQ * D")
    parser.add_argument("--group", type=bounded(int, 1), default=4, help="HQ / HKV")
    parser.add_argument("--decode-cache", type=bounded(int, 1), nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--csv", help="also write every row to this CSV file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script, not speed")
    parser.add_argument("--compile-only", type=bounded(int, 1), metavar="SM",
                        help="compile the kernels for sm_SM, no GPU needed")
    parser.add_argument("--all-configs", action="store_true", help="with --compile-only: every autotune config too")
    args = parser.parse_args(argv)

    if args.compile_only:
        return 1 if compile_only(args.compile_only, args.head_dims, args.all_configs) else 0

    if args.smoke:
        device, dtype = "cpu", torch.float32
        args.seqlens, args.head_dims, args.tokens, args.width, args.group = [32, 64], [16], 64, 32, 2
        args.decode_cache = [128]
        name, peak, versions = "CPU (smoke: fused is the torch reference)", None, f"torch {torch.__version__}"
    elif not torch.cuda.is_available():
        print("gated_sdpa benchmark: no CUDA: skipped (the Triton kernels need a GPU; --smoke checks the script)")
        return 0
    else:
        try:
            import triton
        except ImportError:
            print("gated_sdpa benchmark: triton is not installed: skipped")
            return 0
        device, dtype = "cuda", torch.bfloat16
        name = torch.cuda.get_device_name()
        peak = peak_tflops(name)
        versions = f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}"

    print(f"{name}; {versions}; {str(dtype).removeprefix('torch.')}, causal, GQA {args.group}:1, elementwise sigmoid "
          f"gate, B*T = {args.tokens}, HQ*D = {args.width}", flush=True)
    write_row = csv_writer(args.csv)
    summary = []
    header = (f"{'T':>6} {'D':>4} {'B':>3}  {'path':<28} {'fwd TF/s':>9} {'fused/path':>10} {'%peak':>6} "
              f"{'fwd+bwd TF/s':>12} {'fused/path':>10} {'max|diff|':>9}")
    print(header)
    print("-" * len(header), flush=True)
    for D in args.head_dims:
        HQ = args.width // D
        HKV = HQ // args.group
        for T in args.seqlens:
            B = max(1, args.tokens // T)
            torch.manual_seed(0)
            inputs = make_inputs(B, T, T, HQ, HKV, D, device, dtype, requires_grad=True)
            grad_out = torch.randn_like(inputs[0])
            found, skipped = peers(inputs, args.smoke)
            for line in skipped:
                print(f"{T:>6} {D:>4} {B:>3}  skipped {line}", flush=True)
            paths = {"fused": fused, **found}
            flops_fwd = 2 * 2 * B * HQ * T * T * D / 2  # two matmuls, causal half
            with torch.no_grad():
                reference = fused(*inputs).float()
            results = {}
            for path, fn in paths.items():
                with torch.no_grad():
                    diff = (fn(*inputs).float() - reference).abs().max().item()
                fwd = flops_fwd / time_ms(fn, inputs) / 1e9  # ms -> TFLOP/s
                both = 3.5 * flops_fwd / time_ms(fn, inputs, grad_out) / 1e9
                results[path] = (fwd, both)
                ratio_fwd, ratio_both = results["fused"][0] / fwd, results["fused"][1] / both
                share = f"{100 * fwd / peak:5.1f}%" if peak else "   n/a"
                shown = "-" if path == "fused" else f"{ratio_fwd:.2f}x"
                shown_both = "-" if path == "fused" else f"{ratio_both:.2f}x"
                print(f"{T:>6} {D:>4} {B:>3}  {path:<28} {fwd:>9.4g} {shown:>10} {share:>6} {both:>12.4g} "
                      f"{shown_both:>10} {diff:>9.2e}", flush=True)
                write_row(dict(kind="prefill", T=T, D=D, B=B, path=path, fwd_tflops=round(fwd, 2),
                                 fwd_bwd_tflops=round(both, 2), fused_over_path_fwd=round(ratio_fwd, 3),
                                 fused_over_path_fwd_bwd=round(ratio_both, 3), max_abs_diff=diff))
            peer_results = {p: r for p, r in results.items() if p != "fused"}
            if peer_results:
                best_fwd = max(peer_results, key=lambda p: peer_results[p][0])
                best_both = max(peer_results, key=lambda p: peer_results[p][1])
                summary.append((T, D, results["fused"], best_fwd, peer_results[best_fwd][0], best_both,
                                peer_results[best_both][1]))

    print("\nfused against the best peer (goals: fwd >= 1.05x, fwd+bwd >= 1.0x)")
    print(f"{'T':>6} {'D':>4}  {'fused fwd':>9} {'best peer fwd':>30} {'ratio':>6}  {'fused f+b':>9} "
          f"{'best peer fwd+bwd':>30} {'ratio':>6}")
    for T, D, (fused_fwd, fused_both), p_fwd, best_fwd, p_both, best_both in summary:
        print(f"{T:>6} {D:>4}  {fused_fwd:>9.1f} {f'{p_fwd} {best_fwd:.1f}':>30} {fused_fwd / best_fwd:>5.2f}x  "
              f"{fused_both:>9.1f} {f'{p_both} {best_both:.1f}':>30} {fused_both / best_both:>5.2f}x")

    print("\ndecode step (T = 1, B = 1, no grad): microseconds; ratio = path time / fused time (> 1: fused faster)")
    print(f"{'cache':>7} {'D':>4}  {'path':<28} {'us':>8} {'path/fused':>10} {'max|diff|':>9}")
    for D in args.head_dims:
        HQ = args.width // D
        HKV = HQ // args.group
        for S in args.decode_cache:
            inputs = make_inputs(1, 1, S, HQ, HKV, D, device, dtype, requires_grad=False)
            found, skipped = peers(inputs, args.smoke)
            for line in skipped:
                print(f"{S:>7} {D:>4}  skipped {line}", flush=True)
            with torch.no_grad():
                reference = fused(*inputs).float()
            t_fused = None
            for path, fn in {"fused": fused, **found}.items():
                with torch.no_grad():
                    diff = (fn(*inputs).float() - reference).abs().max().item()
                us = time_ms(fn, inputs) * 1e3
                t_fused = t_fused or us
                print(f"{S:>7} {D:>4}  {path:<28} {us:>8.1f} {us / t_fused:>9.2f}x {diff:>9.2e}", flush=True)
                write_row(dict(kind="decode", T=1, S=S, D=D, B=1, path=path, microseconds=round(us, 2),
                                 path_over_fused=round(us / t_fused, 3), max_abs_diff=diff))

    if device == "cuda":
        print("\nautotuned launch configs:")
        print("\n".join(autotuned_configs()) or "  none (GATED_ATTENTION_TRITON_AUTOTUNE=0?)")
    if args.csv:
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
