"""The Triton gated-SDPA kernels against the torch reference, and `attn_implementation="gated_triton"`.

Runs on CUDA, or on the CPU in triton's interpreter when the process started with TRITON_INTERPRET=1;
`test_gated_sdpa.py::test_triton_kernels_under_the_interpreter` runs this file that way on machines
without a GPU (see that module's docstring). Sizes are tiny because the interpreter is slow.

Tolerance (`assert_matches`): with ref the fp32 torch reference and torch_same the same torch computation
in the tested dtype, the output and every gradient must satisfy
    max|kernel - ref| <= 2 * max|torch_same - ref| + FLOOR[dtype] * max|ref| + cancellation_floor(...).
FLOOR is about one unit in the last place for fp16/bf16. For fp32, torch_same *is* the reference (error
0), so the floors alone bound the kernel: 1e-5 relative allows another summation order, while a masking
or indexing bug gives O(1) errors. A gradient that is exactly 0 in exact arithmetic (dq at T = 1) has
max|ref| = 0 and needs the absolute `cancellation_floor`, scaled to the inputs (see there). Test ids
name the dtype that ran. Under the interpreter bf16 `tl.dot` operands are rounded to bf16 and then
multiplied in fp32 (the interpreter's bf16 dot is wrong), so bf16 here checks the kernels' roundings,
not the GPU's bf16 tensor cores.
"""

from __future__ import annotations

import os

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1 from the start; test_gated_sdpa.py runs this file under the interpreter",
        allow_module_level=True,
    )

kernels = pytest.importorskip("gated_attention.kernels.gated_sdpa.triton")

from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM  # noqa: E402
from gated_attention.kernels import gated_sdpa  # noqa: E402
from gated_attention.kernels.gated_sdpa.reference import gated_sdpa_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = ("out", "dq", "dk", "dv", "dgate")


def make_inputs(B, T, S, HQ, HKV, D, gate, seed=0):
    """fp32 [q, k, v, gate logits] and an output gradient; q [B, T, HQ, D], k/v [B, S, HKV, D]."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, HQ), (S, HKV), (S, HKV)))
    elementwise, headwise = torch.randn(B, T, HQ, D, generator=g), torch.randn(B, T, HQ, generator=g)
    logits = {None: None, "elementwise": elementwise, "headwise": headwise}
    return [q, k, v, logits[gate]], torch.randn(B, T, HQ, D, generator=g)


def run(fn, inputs, grad_out, dtype, **kwargs):
    """[out, dq, dk, dv(, dgate)] of fn on copies of inputs cast to dtype, on DEVICE."""
    leaves = [None if x is None else x.to(DEVICE, dtype).requires_grad_() for x in inputs]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, [x for x in leaves if x is not None], grad_out.to(DEVICE, dtype))
    return [out.detach(), *grads]


def cancellation_floor(inputs, grad_out, scale=None) -> float:
    """Absolute error allowed for a result that is a cancellation, e.g. 0 in exact arithmetic.

    dq and dk are built from ds = p * (dp - delta), where dp = dO . v and delta = rowsum(dO * O) are both
    D-term sums accumulated in fp32 (for every input dtype). Where they are equal in exact arithmetic
    (T = 1: p = 1 and O = v, so dq is exactly 0), another summation order leaves rounding noise of up to
    about D * u * max|dO| * max|v| (u the fp32 unit roundoff, the usual bound for a D-term sum), multiplied
    by scale * max|k| (dq) or scale * max|q| (dk). On a GPU the T = 1 dq came out as 6.6e-7 against a zero
    reference; this floor is 6e-6 for that case and below 1e-5 * max|ref| in the others.
    """
    q, k, v = inputs[:3]
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    q_or_k, do, v = max(q.abs().max().item(), k.abs().max().item()), grad_out.abs().max().item(), v.abs().max().item()
    return D * torch.finfo(torch.float32).eps * scale * q_or_k * do * v


def assert_matches(kernel_results, dtype, inputs, grad_out, reference=gated_sdpa_reference, **kwargs):
    """The module docstring's tolerance, for the output and every gradient."""
    ref = run(reference, inputs, grad_out, torch.float32, **kwargs)
    floor = cancellation_floor(inputs, grad_out, kwargs.get("scale"))
    same = ref if dtype == torch.float32 else run(reference, inputs, grad_out, dtype, **kwargs)
    assert len(kernel_results) == len(ref)
    for name, got, r, s in zip(NAMES, kernel_results, ref, same):
        assert got.dtype == dtype and got.shape == r.shape, name
        r = r.float()
        err = (got.float() - r).abs().max().item()
        err_torch = (s.float() - r).abs().max().item()
        bound = 2 * err_torch + FLOOR[dtype] * r.abs().max().item() + floor
        assert err <= bound, f"{name} ({dtype}): kernel error {err:.3g} > {bound:.3g} (torch error {err_torch:.3g})"


def triton_sdpa(*args, **kwargs):
    return gated_sdpa(*args, backend="triton", **kwargs)


# --- the kernels against the reference -----------------------------------------------------------------

DENSE_CASES = {
    # id: B, T, S, HQ, HKV, D, gate, causal, gate activation
    "T1-mha-nogate": (1, 1, 1, 1, 1, 16, None, True, "sigmoid"),
    "T70-gqa2-elementwise-causal": (2, 70, 70, 4, 2, 32, "elementwise", True, "sigmoid"),
    "T45-mqa4-headwise-noncausal-ns_sigmoid": (1, 45, 45, 4, 1, 16, "headwise", False, "ns_sigmoid"),
    "T20-S53-mha-nogate-causal-chunk": (1, 20, 53, 2, 2, 16, None, True, "sigmoid"),  # bottom-right mask
    "T9-S4-gqa2-elementwise-causal-empty-rows": (1, 9, 4, 2, 1, 16, "elementwise", True, "sigmoid"),
}
# Every case in fp32; the two largest also in the 16-bit dtypes (the interpreter is slow).
DENSE_PARAMS = [pytest.param(case, "fp32", id=f"{case}-fp32") for case in DENSE_CASES] + [
    pytest.param(case, dtype, id=f"{case}-{dtype}")
    for case in ("T70-gqa2-elementwise-causal", "T45-mqa4-headwise-noncausal-ns_sigmoid")
    for dtype in ("fp16", "bf16")
]


@pytest.mark.parametrize("case,dtype_name", DENSE_PARAMS)
def test_kernel_matches_reference(case, dtype_name):
    B, T, S, HQ, HKV, D, gate, causal, act = DENSE_CASES[case]
    dtype = DTYPES[dtype_name]
    inputs, grad_out = make_inputs(B, T, S, HQ, HKV, D, gate)
    assert kernels.decode_splits(inputs[0].to(DEVICE), inputs[1].to(DEVICE), None) == 1  # the ordinary forward
    kwargs = dict(causal=causal, gate_activation=act)
    results = run(triton_sdpa, inputs, grad_out, dtype, **kwargs)
    assert_matches(results, dtype, inputs, grad_out, **kwargs)
    if causal and T > S:  # rows that see no key: exact zeros and a zero gradient
        assert not results[0][:, : T - S].any() and not results[1][:, : T - S].any()


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_kernel_packed_sequences(dtype_name):
    """Packed lengths 1, 15, 100, 300: shorter than a block, not block multiples, several blocks."""
    dtype = DTYPES[dtype_name]
    cu_seqlens = torch.tensor([0, 1, 16, 116, 416], dtype=torch.int32, device=DEVICE)
    inputs, grad_out = make_inputs(1, 416, 416, 2, 1, 16, "elementwise")
    results = run(triton_sdpa, inputs, grad_out, dtype, cu_seqlens=cu_seqlens)
    assert_matches(results, dtype, inputs, grad_out, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize(
    "T,HKV,gate,dtype_name",
    [(1, 1, "headwise", "fp32"), (3, 2, "elementwise", "fp32"), (3, 2, "elementwise", "bf16")],
    ids=["T1-mqa4-headwise-fp32", "T3-gqa2-elementwise-fp32", "T3-gqa2-elementwise-bf16"],
)
def test_kernel_decode_against_a_cache(T, HKV, gate, dtype_name):
    """Few queries against a 200-key cache take the split-KV path; the cache is strided as transformers' is."""
    dtype, S, HQ, D = DTYPES[dtype_name], 200, 4, 16
    inputs, grad_out = make_inputs(1, T, S, HQ, HKV, D, gate)
    assert kernels.decode_splits(inputs[0].to(DEVICE), inputs[1].to(DEVICE), None) > 1

    def from_cache(q, k, v, g):  # k, v stored [B, HKV, S, D] as in a DynamicCache; the kernel gets views
        return triton_sdpa(q, k.transpose(1, 2), v.transpose(1, 2), g)

    q, k, v, g = inputs
    results = run(from_cache, [q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), g], grad_out, dtype)
    results[2:4] = [x.transpose(1, 2) for x in results[2:4]]  # dk, dv back to [B, S, HKV, D]
    assert_matches(results, dtype, inputs, grad_out)


# --- learned sinks (GPT-OSS's): one more term in each row's softmax, no value ------------------------------

SINK_CASES = {
    # id: B, T, S, HQ, HKV, D, gate, causal
    "T70-gqa2-elementwise-causal": (2, 70, 70, 4, 2, 32, "elementwise", True),
    "T45-mha-nogate-noncausal": (1, 45, 45, 2, 2, 16, None, False),
    "T9-S4-mqa-headwise-causal-empty-rows": (1, 9, 4, 2, 1, 16, "headwise", True),
    "T3-S200-gqa2-elementwise-decode": (1, 3, 200, 4, 2, 16, "elementwise", True),  # the split-KV path
}
# fp32 only: the sinks change where each row's softmax starts, in fp32 statistics whatever the input dtype.
SINK_PARAMS = [pytest.param(case, "fp32", id=f"{case}-fp32") for case in SINK_CASES]


def with_sinks(fn):
    """`fn` taking the sinks as its fifth positional input, so that `run` differentiates them too."""
    return lambda q, k, v, g, sinks, **kw: fn(q, k, v, g, sinks=sinks, **kw)


@pytest.mark.parametrize("case,dtype_name", SINK_PARAMS)
def test_kernel_with_sinks_matches_reference(case, dtype_name):
    B, T, S, HQ, HKV, D, gate, causal = SINK_CASES[case]
    dtype = DTYPES[dtype_name]
    inputs, grad_out = make_inputs(B, T, S, HQ, HKV, D, gate)
    inputs.append(torch.randn(HQ, generator=torch.Generator().manual_seed(1)) * 2)  # logits of a few units
    assert (kernels.decode_splits(inputs[0].to(DEVICE), inputs[1].to(DEVICE), None) > 1) == case.endswith("decode")
    results = run(with_sinks(triton_sdpa), inputs, grad_out, dtype, causal=causal)
    assert_matches(results, dtype, inputs, grad_out, reference=with_sinks(gated_sdpa_reference), causal=causal)
    if causal and T > S:  # a row that sees no key keeps only the sink: output 0
        assert not results[0][:, : T - S].any()


def test_kernel_with_sinks_packed_sequences():
    cu_seqlens = torch.tensor([0, 1, 16, 116], dtype=torch.int32, device=DEVICE)
    inputs, grad_out = make_inputs(1, 116, 116, 2, 1, 16, "elementwise")
    inputs.append(torch.tensor([1.5, -2.0]))
    results = run(with_sinks(triton_sdpa), inputs, grad_out, torch.float32, cu_seqlens=cu_seqlens)
    assert_matches(results, torch.float32, inputs, grad_out, reference=with_sinks(gated_sdpa_reference),
                   cu_seqlens=cu_seqlens)


def test_unsupported_head_dim_falls_back():
    inputs, _ = make_inputs(1, 5, 5, 2, 1, 24, "elementwise")
    q, k, v, g = (x.to(DEVICE) for x in inputs)
    torch.testing.assert_close(gated_sdpa(q, k, v, g), gated_sdpa_reference(q, k, v, g), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        gated_sdpa(q, k, v, g, backend="triton")


def test_batch_entries_past_int32_offsets_fall_back(monkeypatch):
    """Offsets inside one batch entry are int32 in the kernels; a longer entry must take the reference path."""
    from gated_attention.kernels.gated_sdpa import triton as kernels

    monkeypatch.setattr(kernels, "INTERPRET", True)  # meta tensors pass the device check on any machine
    q = torch.empty(1, 2**19, 32, 128, device="meta", dtype=torch.bfloat16)  # 2**31 elements in one entry
    k = torch.empty(1, 2**19, 8, 128, device="meta", dtype=torch.bfloat16)
    assert "2**31" in kernels.unsupported_reason(q, k, k, "sigmoid")
    q, k = q[:, :-1], k[:, :-1]  # one query row fewer: the farthest offset is 2**31 - 4097
    assert kernels.unsupported_reason(q, k, k, "sigmoid") is None
    # A view's strides count, not its size: v holds 2**29 elements but spans about 2**33.
    v = torch.empty(1, 2**19 - 1, 8, 2048, device="meta", dtype=torch.bfloat16)[..., :128]
    assert "2**31" in kernels.unsupported_reason(q, k, v, "sigmoid")


# --- attn_implementation="gated_triton" in a model -------------------------------------------------------

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # head_dim 16


def tiny_model(attn_gate, **fields) -> GatedAttentionForCausalLM:
    model = GatedAttentionForCausalLM(GatedAttentionConfig(**TINY, attn_gate=attn_gate, **fields)).to(DEVICE)
    if model.config.attention_sinks:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)  # near 0 a sink barely shows
    return model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records each call that reaches the Triton path (gated_sdpa looks the entry point up on every call)."""
    calls = []
    entry = kernels.gated_sdpa_triton

    def recorded(*args, **kwargs):
        calls.append(args[3] is not None)  # whether a gate was fused
        return entry(*args, **kwargs)

    monkeypatch.setattr(kernels, "gated_sdpa_triton", recorded)
    return calls


def logits_and_grads(model, implementation, ids, attention_mask=None):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    logits = model(ids, attention_mask=attention_mask).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "attn_gate",
    [
        {"position": "G1", "granularity": "elementwise"},
        {"position": "G1", "granularity": "headwise", "head_shared": True, "activation": "ns_sigmoid"},
        {"position": "G1", "granularity": "elementwise", "input_dependent": False},
        {"position": "G1", "rank": 4, "input_channels": 24},
        {"position": "G1", "sinks": True},
        None,
    ],
    ids=["G1-elementwise", "G1-headwise-shared-ns_sigmoid", "G1-input-independent", "G1-low-rank-input-channels",
         "G1-sinks", "no-gate"],
)
def test_model_gated_triton_matches_sdpa(kernel_calls, attn_gate):
    """fp32 model: fused-kernel logits and every parameter gradient equal the "sdpa" ones (1e-5 relative)."""
    sinks = attn_gate is not None and attn_gate.pop("sinks", False)
    model = tiny_model(attn_gate, attention_sinks=sinks)
    ids = torch.randint(0, TINY["vocab_size"], (2, 21), device=DEVICE)
    logits, grads = logits_and_grads(model, "sdpa", ids)
    fused_logits, fused_grads = logits_and_grads(model, "gated_triton", ids)
    assert kernel_calls == [attn_gate is not None] * TINY["num_hidden_layers"]  # one call per layer, gate fused
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=1e-5 * logits.abs().max().item())
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("sinks", [False, True], ids=["gate", "gate-sinks"])
def test_model_left_padding_falls_back_to_sdpa(kernel_calls, sinks):
    """A padded batch needs a mask: "gated_triton" runs transformers' SDPA + gate, so results equal "sdpa"."""
    model = tiny_model({"position": "G1"}, attention_sinks=sinks)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    logits, grads = logits_and_grads(model, "sdpa", ids, mask)
    fused_logits, fused_grads = logits_and_grads(model, "gated_triton", ids, mask)
    assert kernel_calls == []
    assert not fused_logits.isnan().any()
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=0, msg=name)


def test_generate_with_gated_triton_uses_the_decode_path(kernel_calls, monkeypatch):
    """Greedy generate() gives the same tokens with "gated_triton" as with "sdpa"; decode steps split the cache."""
    splits = []
    decode_splits = kernels.decode_splits

    def recorded(*args):
        splits.append(decode_splits(*args))
        return splits[-1]

    monkeypatch.setattr(kernels, "decode_splits", recorded)
    model = tiny_model({"position": "G1", "granularity": "headwise"}).eval()
    prompt = torch.randint(0, TINY["vocab_size"], (1, 70), device=DEVICE)  # > 64 cached keys: two or more slices
    generated = {}
    for implementation in ("sdpa", "gated_triton"):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    assert torch.equal(generated["gated_triton"], generated["sdpa"])
    assert len(kernel_calls) == 3 * TINY["num_hidden_layers"]  # prefill + 2 decode steps
    assert splits[:2] == [1, 1] and min(splits[2:]) > 1  # prefill (2 layers): ordinary forward; decode: split KV


def test_model_packed_sequences_use_the_kernel(kernel_calls):
    """B = 1 with three packed sequences: the fused kernel with cu_seqlens equals "sdpa" with its packed mask."""
    model = tiny_model({"position": "G1", "granularity": "elementwise"})
    lengths = [5, 9, 7]
    ids = torch.randint(0, TINY["vocab_size"], (1, sum(lengths)), device=DEVICE)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)  # restarts mark the sequences
    cu = torch.tensor([0, 5, 14, 21], dtype=torch.int32, device=DEVICE)
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    results = {}
    for implementation in ("sdpa", "gated_triton"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        logits = model(ids, position_ids=position_ids, use_cache=False, **flash_kwargs).logits
        logits.square().mean().backward()
        results[implementation] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert kernel_calls == [True] * TINY["num_hidden_layers"]
    (logits, grads), (fused_logits, fused_grads) = results["sdpa"], results["gated_triton"]
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=1e-5 * logits.abs().max().item())
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)
