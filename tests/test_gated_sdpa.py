"""gated_sdpa: the torch reference against hand-written math, the dispatch, and the Triton kernel tests.

The kernel tests live in `test_gated_sdpa_triton.py`. Without a GPU they need triton's interpreter,
which must be switched on (TRITON_INTERPRET=1) before triton itself is imported: triton's own
`tl.sigmoid`, `tl.max`, ... are `@triton.jit` functions fixed at import. In this test process triton is
already imported (transformers.modeling_utils imports it) and the variable would leak into every other
test module, so `test_triton_kernels_under_the_interpreter` runs that file in a child pytest with the variable
set; nothing in this process changes. With a GPU (or a suite started with TRITON_INTERPRET=1) that file
runs in-process and the child is not needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gated_attention.kernels import gated_sdpa
from gated_attention.kernels.gated_sdpa.reference import causal_mask, gated_sdpa_reference

KERNEL_MODULE = "gated_attention.kernels.gated_sdpa.triton"
KERNEL_TESTS = Path(__file__).with_name("test_gated_sdpa_triton.py")


def make_inputs(B, T, S, HQ, HKV, D, gate, seed=0):
    """fp32 q [B, T, HQ, D], k/v [B, S, HKV, D] and gate logits ([B, T, HQ, D] or [B, T, HQ] or None)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, HQ), (S, HKV), (S, HKV)))
    elementwise, headwise = torch.randn(B, T, HQ, D, generator=g), torch.randn(B, T, HQ, generator=g)
    logits = {None: None, "elementwise": elementwise, "headwise": headwise}
    return q, k, v, logits[gate]


def naive_gated_attention(q, k, v, gate, allowed, scale, sinks=None):
    """softmax over the allowed keys (and a sink column, dropped after), written out; `allowed` [T, S] bool; rows with
    no allowed key give 0."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [B, S, HQ, D]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_column.to(scores.dtype)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., : k.shape[1]]  # fully masked rows: NaN -> 0
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    if gate is not None:
        out = out * (torch.sigmoid(gate) if gate.dim() == 4 else torch.sigmoid(gate)[..., None])
    return out


# --- the reference against hand-written math -----------------------------------------------------------


@pytest.mark.parametrize(
    "T,S,causal,HKV,gate",
    [
        (6, 6, True, 2, "elementwise"),
        (3, 8, True, 1, "headwise"),
        (7, 3, True, 4, None),
        (5, 9, False, 2, "elementwise"),
    ],
    ids=["T=S", "T<S-bottom-right", "T>S-empty-rows", "non-causal"],
)
def test_reference_matches_explicit_softmax(T, S, causal, HKV, gate):
    q, k, v, g = (None if x is None else x.double() for x in make_inputs(2, T, S, 4, HKV, 8, gate))
    allowed = causal_mask(T, S) if causal else torch.ones(T, S, dtype=torch.bool)
    expected = naive_gated_attention(q, k, v, g, allowed, scale=8**-0.5)
    got = gated_sdpa(q, k, v, g, causal=causal, backend="torch")
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)  # fp64: only rounding differs
    if causal and T > S:
        assert not got[:, : T - S].any()


@pytest.mark.parametrize("T,S,causal", [(7, 7, True), (3, 9, True), (6, 4, True), (5, 5, False)],
                         ids=["T=S", "T<S-bottom-right", "T>S-empty-rows", "non-causal"])
def test_reference_sinks_are_one_more_softmax_column(T, S, causal):
    q, k, v, g = (x.double() for x in make_inputs(2, T, S, 4, 2, 8, "elementwise"))
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], dtype=torch.float64)
    allowed = causal_mask(T, S) if causal else torch.ones(T, S, dtype=torch.bool)
    expected = naive_gated_attention(q, k, v, g, allowed, scale=8**-0.5, sinks=sinks)
    got = gated_sdpa(q, k, v, g, causal=causal, backend="torch", sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)  # fp64: only rounding differs


def test_reference_packed_sequences_attend_only_to_themselves():
    lengths = [1, 4, 7]
    cu_seqlens = torch.tensor([0, 1, 5, 12], dtype=torch.int32)
    q, k, v, g = (x.double() for x in make_inputs(1, 12, 12, 2, 1, 8, "headwise"))
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seq[:, None] == seq[None, :]) & causal_mask(12, 12)
    expected = naive_gated_attention(q, k, v, g, allowed, scale=8**-0.5)
    got = gated_sdpa(q, k, v, g, cu_seqlens=cu_seqlens, backend="torch")
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


# --- dispatch ----------------------------------------------------------------------------------------------


def test_bad_inputs_raise():
    q, k, v, g = make_inputs(1, 4, 4, 4, 2, 8, "elementwise")
    with pytest.raises(ValueError, match="HQ % HKV"):
        gated_sdpa(q, k[:, :, :1].expand(1, 4, 3, 8), v[:, :, :1].expand(1, 4, 3, 8))
    with pytest.raises(ValueError, match="gate must be"):
        gated_sdpa(q, k, v, g[..., :4])
    with pytest.raises(ValueError, match="backend"):
        gated_sdpa(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="gate_activation"):
        gated_sdpa(q, k, v, g, gate_activation="silu")


def test_missing_triton_falls_back_to_the_reference(monkeypatch):
    """Where triton does not import, "auto" runs the reference and "triton" says why it cannot run."""
    monkeypatch.setitem(sys.modules, KERNEL_MODULE, None)  # makes `from .gated_sdpa_triton import ...` fail
    q, k, v, g = make_inputs(1, 5, 5, 2, 1, 16, "elementwise")
    torch.testing.assert_close(gated_sdpa(q, k, v, g), gated_sdpa_reference(q, k, v, g), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="cannot run"):
        gated_sdpa(q, k, v, g, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the Triton path runs")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="under the interpreter the Triton path runs")
def test_cpu_tensors_run_the_reference():
    q, k, v, g = make_inputs(1, 5, 5, 2, 1, 16, "headwise")
    torch.testing.assert_close(gated_sdpa(q, k, v, g), gated_sdpa_reference(q, k, v, g), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="cannot run"):  # "tensors are on cpu", or triton is missing
        gated_sdpa(q, k, v, g, backend="triton")


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_models_default_to_sdpa_even_on_cuda(family, monkeypatch, tmp_path):
    """No attn_implementation asked for: transformers' "sdpa" on every machine, CUDA included; "gated_triton"
    only when asked for, at build, at load or later.

    The default follows measurement (the H200 table in benchmarks/RESULTS.md: the fused kernel is slower than SDPA + gate there). The
    CUDA machine is simulated; the choice is made when the model is built and again when it is loaded.
    """
    pytest.importorskip("triton")
    from gated_attention import GatedAttentionConfig, GatedDeltaNetHybridConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8)
    if family == "dense":
        make_config = lambda **kw: GatedAttentionConfig(num_hidden_layers=2, **shape, **kw)  # noqa: E731
    else:
        make_config = lambda **kw: GatedDeltaNetHybridConfig(  # noqa: E731
            num_hidden_layers=4, hybrid_ratio="2:1", linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, **shape, **kw,
        )
    AutoModelForCausalLM.from_config(make_config()).save_pretrained(tmp_path)
    # A fresh config each time: building a model records the implementation in its config, which then counts as asked.
    built = lambda **kw: AutoModelForCausalLM.from_config(make_config(), **kw).config._attn_implementation  # noqa: E731
    loaded = lambda **kw: AutoModelForCausalLM.from_pretrained(tmp_path, **kw).config._attn_implementation  # noqa: E731

    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert (built(), loaded()) == ("sdpa", "sdpa"), f"cuda={cuda}"
        fused = dict(attn_implementation="gated_triton")
        assert (built(**fused), loaded(**fused)) == ("gated_triton", "gated_triton"), f"cuda={cuda}"
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    model.set_attn_implementation("gated_triton")
    assert model.config._attn_implementation == "gated_triton"


def test_tests_pin_one_launch_config_and_autotuning_keys_on_length_buckets(monkeypatch):
    """conftest sets GATED_ATTENTION_TRITON_AUTOTUNE=0: one config per kernel; the autotuner's key holds
    power-of-two length buckets, so one shape's tuning does not fix the tiles for every length."""
    kernels = pytest.importorskip(KERNEL_MODULE)
    for kernel in (kernels.fwd_kernel, kernels.bwd_dq_kernel, kernels.bwd_dkdv_kernel):
        assert len(kernel.configs) == 1
        assert {"T_BUCKET", "S_BUCKET"} <= set(kernel.keys)
    lengths = (1, 128, 129, 1000, 4096, 5000, 100_000)
    assert [kernels.seq_bucket(n) for n in lengths] == [128, 128, 256, 1024, 4096, 8192, 16384]
    gpu = [(128, 64, 4, 3), (64, 64, 4, 3)]
    monkeypatch.setattr(kernels, "INTERPRET", False)
    monkeypatch.setattr(kernels, "AUTOTUNE", True)
    assert [(c.kwargs["BLOCK_M"], c.num_stages) for c in kernels.launch_configs(gpu, (64, 32))] == [(128, 3), (64, 3)]
    monkeypatch.setattr(kernels, "AUTOTUNE", False)
    assert [(c.kwargs["BLOCK_M"], c.num_stages) for c in kernels.launch_configs(gpu, (64, 32))] == [(128, 3)]
    monkeypatch.setattr(kernels, "INTERPRET", True)
    assert [c.kwargs["BLOCK_N"] for c in kernels.launch_configs(gpu, (64, 32))] == [32]


# --- the kernel tests, in a child process under the interpreter ----------------------------------------


def test_triton_kernels_under_the_interpreter():
    """Runs test_gated_sdpa_triton.py with TRITON_INTERPRET=1 in a child pytest (see the module docstring)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernel tests run in this process (test_gated_sdpa_triton.py)")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(KERNEL_TESTS)]
    repo = KERNEL_TESTS.parent.parent
    child = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    report = child.stdout + child.stderr
    print(report)  # the per-test lines (ids name the dtypes) show with `pytest -rP`
    assert child.returncode == 0, f"kernel tests failed under the interpreter:\n{report[-6000:]}"
    summary = child.stdout.strip().splitlines()[-1]  # "N passed in ...s"; a skip would mean a kernel did not run
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, report[-3000:]
