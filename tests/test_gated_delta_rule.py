"""The torch path of `gated_delta_rule` against fla's naive recurrent reference.

The reference is fla's token-by-token loop (`fla.ops.gated_delta_rule.naive`),
read straight from fla's source file: importing the `fla` package itself costs
seconds of CPU and is not needed for a plain-torch function.

Tolerance 1e-5 (absolute, fp32, outputs of magnitude ~1): both compute in fp32,
but the chunked form sums in a different order (per-chunk matmuls, a triangular
solve) from the recurrent loop, so results agree to rounding, a
few 1e-7 per step, not bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from gated_attention.kernels import gated_delta_rule
from gated_attention.kernels.gated_delta_rule.chunk import chunked_gated_delta_rule, torch_gated_delta_rule, unit_lower_inverse

ATOL = 1e-5


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip(
            "flash-linear-attention is not installed (its naive reference is the ground truth here)",
            allow_module_level=True,
        )
    path = os.path.join(os.path.dirname(spec.origin), "ops", "gated_delta_rule", "naive.py")
    module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_recurrent_gated_delta_rule


naive_recurrent = _load_fla_naive()


def make_inputs(B=2, T=100, H=2, K=16, V=24, HV=None, dtype=torch.float32):
    HV = HV or H
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)  # the callers' l2 norm, as fla expects
    v = torch.randn(B, T, HV, V)
    g = F.logsigmoid(torch.randn(B, T, HV))  # log decays, as a GDN layer produces them
    beta = torch.rand(B, T, HV)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def reference(q, k, v, g, beta, initial_state=None):
    HV, H = v.shape[2], q.shape[2]
    if HV != H:  # the naive loop has no grouped value heads: expand q/k as fla's kernels map them
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    # note the naive reference's argument order: beta before g
    return naive_recurrent(q, k, v, beta, g, initial_state=initial_state, output_final_state=True)


@pytest.mark.parametrize(
    "T", [1, 5, 64, 100, 200], ids=["decode-1", "short-5", "one-chunk-64", "padded-100", "four-chunks-200"]
)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_matches_fla_naive_recurrent(T, with_state):
    q, k, v, g, beta = make_inputs(T=T)
    h0 = torch.randn(2, 2, 16, 24) if with_state else None
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref_o, ref_final = reference(q, k, v, g, beta, initial_state=h0)
    assert o.shape == ref_o.shape == (2, T, 2, 24)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=ATOL, rtol=0)


@pytest.mark.parametrize("HV", [2, 4], ids=["value-heads-2", "grouped-value-heads-4"])
@pytest.mark.parametrize("l2", [False, True], ids=["unnormalised", "l2-in-kernel"])
def test_a_decode_step_is_the_chunk_path_bit_for_bit(HV, l2):
    """T = 1 takes a recurrent step: the chunk path's three matmuls without its set-up, so the same numbers."""
    q, k, v, g, beta = make_inputs(T=1, HV=HV)
    h0 = torch.randn(2, HV, 16, 24)
    step = torch_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    chunk = chunked_gated_delta_rule(q, k, v, g, beta, 16**-0.5, h0, True, l2, 64)
    assert torch.equal(step[0], chunk[0]) and torch.equal(step[1], chunk[1])
    # and both are the naive recurrence's step, to rounding
    ref = reference(*(torch.nn.functional.normalize(x, dim=-1, eps=1e-6) if l2 and i < 2 else x
                      for i, x in enumerate((q, k, v, g, beta))), initial_state=h0)
    torch.testing.assert_close(step[0], ref[0], atol=ATOL, rtol=0)


def test_final_state_only_when_asked():
    q, k, v, g, beta = make_inputs(T=10)
    o, final = gated_delta_rule(q, k, v, g, beta)
    assert final is None
    torch.testing.assert_close(o, reference(q, k, v, g, beta)[0], atol=ATOL, rtol=0)


def test_continuing_from_the_final_state_equals_one_pass():
    """Prefill then decode, as generate() runs it: the state carries everything."""
    q, k, v, g, beta = make_inputs(T=90)
    full, full_state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, state = gated_delta_rule(*(x[:, :77] for x in (q, k, v, g, beta)), output_final_state=True)
    outs = [first]
    for t in range(77, 90):
        o, state = gated_delta_rule(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=state, output_final_state=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, full_state, atol=ATOL, rtol=0)


def test_grouped_value_heads():
    q, k, v, g, beta = make_inputs(T=70, H=2, HV=4)
    o, final = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    ref_o, ref_final = reference(q, k, v, g, beta)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=ATOL, rtol=0)


def test_l2norm_in_kernel_and_scale():
    q, k, v, g, beta = make_inputs(T=70)
    k_raw = k * torch.rand(*k.shape[:-1], 1) * 3  # not unit length
    o, _ = gated_delta_rule(q, k_raw, v, g, beta, use_qk_l2norm_in_kernel=True, scale=0.3)
    qn, kn = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k_raw))
    ref_o = naive_recurrent(qn, kn, v, beta, g, scale=0.3)[0]
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=0)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_packed_sequences_equal_one_by_one(with_state):
    lengths = [37, 1, 130, 64]
    seqs = [make_inputs(B=1, T=n) for n in lengths]
    h0 = torch.randn(len(lengths), 2, 16, 24) if with_state else None
    packed = [torch.cat([s[i] for s in seqs], dim=1) for i in range(5)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    o, final = gated_delta_rule(*packed, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    start = 0
    for i, (n, seq) in enumerate(zip(lengths, seqs)):
        alone, alone_state = gated_delta_rule(
            *seq, initial_state=None if h0 is None else h0[i : i + 1], output_final_state=True
        )
        # the same function on the same numbers, one sequence at a time: identical
        assert torch.equal(o[:, start : start + n], alone)
        assert torch.equal(final[i : i + 1], alone_state)
        start += n


def test_packed_sequences_need_batch_one():
    q, k, v, g, beta = make_inputs(B=2, T=8)
    with pytest.raises(ValueError, match="batch size 1"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 8]))


def test_gradients_match_reference():
    inputs = make_inputs(T=100)
    h0 = torch.randn(2, 2, 16, 24)
    ours = [x.clone().requires_grad_() for x in (*inputs, h0)]
    refs = [x.clone().requires_grad_() for x in (*inputs, h0)]
    o, s = gated_delta_rule(*ours[:5], initial_state=ours[5], output_final_state=True)
    ro, rs = reference(*refs[:5], initial_state=refs[5])
    wo, ws = torch.randn_like(o), torch.randn_like(s)
    ((o * wo).sum() + (s * ws).sum()).backward()
    ((ro * wo).sum() + (rs * ws).sum()).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], ours, refs):
        # gradients reach ~10 in magnitude here; rounding differences scale with them
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_low_precision_inputs_compute_in_fp32():
    q, k, v, g, beta = make_inputs(T=80)
    o, _ = gated_delta_rule(*(x.bfloat16() for x in (q, k, v)), g, beta)
    assert o.dtype == torch.bfloat16
    ref_o = reference(*(x.bfloat16().float() for x in (q, k, v)), g, beta)[0]
    # only the final rounding to bf16 differs: half a bf16 ulp relative (2^-9)
    torch.testing.assert_close(o.float(), ref_o, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("C", [1, 2, 16, 64])
def test_unit_lower_inverse(C):
    m = torch.randn(3, C, C, dtype=torch.float64) * 0.3
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + m.tril(-1))
    torch.testing.assert_close(unit_lower_inverse(m), expected, atol=1e-10, rtol=1e-10)


def test_backend_choice_is_checked():
    q, k, v, g, beta = make_inputs(T=4)
    with pytest.raises(ValueError, match="backend"):
        gated_delta_rule(q, k, v, g, beta, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("T", [1, 50, 300])
def test_fla_on_cuda_matches_torch(T):
    inputs = [x.cuda() for x in make_inputs(T=T)]
    h0 = torch.randn(2, 2, 16, 24, device="cuda")
    o, s = gated_delta_rule(*inputs, initial_state=h0, output_final_state=True)  # auto: fla on CUDA
    ro, rs = gated_delta_rule(*inputs, initial_state=h0, output_final_state=True, backend="torch")
    # fla's kernels use tf32 tensor cores for fp32 matmuls: ~1e-3 relative
    torch.testing.assert_close(o, ro, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(s, rs, atol=5e-3, rtol=5e-3)


def _triton_range_fla_refuses() -> bool:
    """Hopper with Triton >= 3.4 and < 3.7.1: fla (>= 0.5.2) refuses the gated backward there (fla #640)."""
    import triton
    from packaging.version import Version

    return torch.cuda.get_device_capability()[0] == 9 and Version("3.4") <= Version(triton.__version__) < Version("3.7.1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("K", [64, 128])
def test_fla_backward_on_cuda_matches_torch(K):
    """fla's chunk backward against the torch path: every gradient, at the head sizes the miscompiled Hopper tile
    (64) and the common one (128) use. fla #640 (Hopper, Triton 3.4 up to 3.7.1) gave dg and dbeta off by half their
    size with no error; from fla 0.5.2 on, fla refuses that combination, which this accepts only there."""
    B, T, H, V = 2, 300, 4, K
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g, beta = torch.randn(B, T, H, V), F.logsigmoid(torch.randn(B, T, H)), torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V)
    weights = [torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")]
    grads = {}
    for backend in ("fla", "torch"):
        leaves = [x.cuda().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, s = gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, backend=backend)
        try:
            ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
        except RuntimeError as e:
            if backend == "fla" and "#640" in str(e) and _triton_range_fla_refuses():
                pytest.skip(f"fla refuses the gated backward here, as it should: {str(e).splitlines()[0]}")
            raise
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads["fla"], grads["torch"]):
        # fla's fp32 matmuls run on tf32 tensor cores (10-bit mantissa) over 300 steps: ~1e-3 of the largest
        # gradient; the miscompiled tile was off by ~0.5 of it
        error = ((a - b).abs().max() / b.abs().max()).item()
        print(f"K={K} d{name}: max |fla - torch| / max |torch| = {error:.2e}")
        assert error < 2e-2, f"d{name}: {error:.3g} of the largest gradient"
