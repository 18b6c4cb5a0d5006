"""The torch paths of fla's ops (gated_attention/fla_cpu) against fla's own plain-torch references.

The references are fla's token-by-token recurrences in `fla/ops/<op>/naive.py`,
read straight from fla's source files (importing the `fla` package costs
seconds and is not needed for a plain-torch function); for the norms and the
rotary embedding, fla's torch twins `rms_norm_ref`, `layer_norm_ref` and
`rotary_embedding_ref` (these need the package). Every case runs in fp32 on
the CPU, with and without an initial state, with the final state compared
too, at lengths that are and are not a multiple of the 64-position chunk.

Tolerance for the recurrences: atol 2e-5, rtol 1e-5. Both sides compute in
fp32, but the chunked form sums in another order (64-term matmuls, a triangular
solve, decays applied per chunk) than the loop, so they agree
to rounding: a few fp32 ulps (1.2e-7 relative) per term, over up to ~200
terms, on outputs and states of magnitude ~1-10 here; the largest difference
measured was 1.6e-5.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from gated_attention.fla_cpu.delta_rule.chunk import torch_delta_rule
from gated_attention.fla_cpu.modules.short_convolution import torch_causal_conv1d, torch_causal_conv1d_update
from gated_attention.fla_cpu.modules.softmax_attention import softmax_attention
from gated_attention.fla_cpu.gla.chunk import decayed_scores, torch_gla
from gated_attention.fla_cpu.hgrn.chunk import torch_hgrn
from gated_attention.fla_cpu.kda.chunk import kda_gate, torch_kda
from gated_attention.fla_cpu.simple_gla.chunk import retention_decay, torch_retention, torch_simple_gla

ATOL, RTOL = 2e-5, 1e-5
LENGTHS = pytest.mark.parametrize("T", [1, 5, 64, 100, 200], ids=["decode-1", "short-5", "one-chunk-64", "padded-100", "four-chunks-200"])
STATES = pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])


def fla_naive(op: str, name: str):
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention is not installed (its naive references are the ground truth here)")
    path = os.path.join(os.path.dirname(spec.origin), "ops", op, "naive.py")
    module_spec = importlib.util.spec_from_file_location(f"fla_{op}_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def qkv(B=2, T=100, H=2, K=16, V=24, HV=None):
    torch.manual_seed(T)
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, HV or H, V)
    return q, k, v


@LENGTHS
@STATES
def test_gla_matches_fla_naive_recurrent(T, with_state):
    q, k, v = qkv(T=T)
    g = F.logsigmoid(torch.randn(2, T, 2, 16))  # per key channel
    h0 = torch.randn(2, 2, 16, 24) if with_state else None
    o, state = torch_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    ref_o, ref_state = fla_naive("gla", "naive_recurrent_gla")(q, k, v, g, initial_state=h0, output_final_state=True)
    close(o, ref_o)
    close(state, ref_state)


def test_gla_state_v_first_is_the_transposed_state():
    """fla's layers keep V-first states ([N, H, V, K]); one continuing from another gives one pass's result."""
    q, k, v = qkv(T=90)
    g = F.logsigmoid(torch.randn(2, 90, 2, 16))
    full, full_state = torch_gla(q, k, v, g, output_final_state=True, state_v_first=True)
    first, state = torch_gla(q[:, :70], k[:, :70], v[:, :70], g[:, :70], output_final_state=True, state_v_first=True)
    rest, end_state = torch_gla(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], initial_state=state,
                                output_final_state=True, state_v_first=True)
    assert state.shape == (2, 2, 24, 16)
    close(torch.cat([first, rest], 1), full)
    close(end_state, full_state)


def test_gla_strong_decay_stays_finite():
    """HGRN2 feeds logsigmoid gates undivided: a channel can decay by e^-30 a step, beyond exp's fp32 range
    within any chunk; the channel-by-channel scores must stay exact there."""
    q, k, v = qkv(T=128)
    g = -30 * torch.rand(2, 128, 2, 16)
    o, _ = torch_gla(q, k, v, g)
    ref_o, _ = fla_naive("gla", "naive_recurrent_gla")(q, k, v, g)
    assert torch.isfinite(o).all()
    close(o, ref_o)


@pytest.mark.parametrize("strict", [False, True], ids=["with-diagonal", "strictly-below"])
@pytest.mark.parametrize("factored,rate", [(True, 1.0), (False, 8.0)], ids=["factored", "channel-by-channel"])
def test_decayed_scores_equal_the_explicit_sum(strict, factored, rate):
    """The scores against the [C, C, K] sum written out: factored through the first row while the decay over
    the chunk stays within exp(-SPAN_LIMIT) (here at most 63 steps of at most 0.6), channel by channel beyond."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 64, 8), torch.randn(3, 64, 8)
    c = (-rate * 0.6 * torch.rand(3, 64, 8)).cumsum(1)
    explicit = (a[:, :, None] * b[:, None] * (c[:, :, None] - c[:, None]).clamp(max=0).exp()).sum(-1)
    mask = torch.ones(64, 64, dtype=torch.bool).tril(-1 if strict else 0)
    close(decayed_scores(a, b, c, strict=strict, factored=factored), explicit * mask)


@LENGTHS
@STATES
def test_simple_gla_matches_fla_naive_recurrent(T, with_state):
    q, k, v = qkv(T=T)
    g = F.logsigmoid(torch.randn(2, T, 2))  # one decay per head
    h0 = torch.randn(2, 2, 16, 24) if with_state else None
    o, state = torch_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    ref = fla_naive("simple_gla", "naive_recurrent_simple_gla")(q, k, v, g, initial_state=h0, output_final_state=True)
    close(o, ref[0])
    close(state, ref[1])


@pytest.mark.parametrize("T", [5, 100])
def test_retention_matches_fla_naive_retention(T):
    """fla's naive retention is the parallel form, in the old [B, H, T, D] layout."""
    q, k, v = qkv(T=T, H=4)
    o, _ = torch_retention(q, k, v)
    ref = fla_naive("retention", "naive_retention")(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    close(o, ref)


def test_retention_decays_continue_through_the_state():
    q, k, v = qkv(T=100, H=4)
    h0 = torch.randn(2, 4, 16, 24)
    o, state = torch_retention(q, k, v, initial_state=h0, output_final_state=True)
    g = retention_decay(4).expand(2, 100, 4)
    ref = fla_naive("simple_gla", "naive_recurrent_simple_gla")(q, k, v, g, initial_state=h0, output_final_state=True)
    close(o, ref[0])
    close(state, ref[1])


@LENGTHS
@STATES
def test_hgrn_matches_fla_naive_recurrent(T, with_state):
    torch.manual_seed(T)
    x, g = torch.randn(2, T, 40), F.logsigmoid(torch.randn(2, T, 40))
    h0 = torch.randn(2, 40) if with_state else None
    o, state = torch_hgrn(x, g, initial_state=h0, output_final_state=True)
    ref_o, ref_state = fla_naive("hgrn", "naive_recurrent_hgrn")(x, g, initial_state=h0, output_final_state=True)
    close(o, ref_o)
    close(state, ref_state)


def test_hgrn_strong_decay():
    """Gates of e^-50 a step (HGRN's first layer has no lower bound): blocks shrink until exp(-c) fits fp32."""
    torch.manual_seed(0)
    x, g = torch.randn(1, 130, 16), -50 * torch.rand(1, 130, 16)
    o, state = torch_hgrn(x, g, output_final_state=True)
    ref_o, ref_state = fla_naive("hgrn", "naive_recurrent_hgrn")(x, g, output_final_state=True)
    close(o, ref_o)
    close(state, ref_state)


@LENGTHS
@STATES
def test_delta_rule_matches_fla_naive_recurrence(T, with_state):
    q, k, v = qkv(T=T)
    beta = torch.rand(2, T, 2)
    h0 = torch.randn(2, 2, 16, 24) if with_state else None
    o, state = torch_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    # fla's naive delta rule is in the old [B, H, T, D] layout
    ref_o, ref_state = fla_naive("delta_rule", "delta_rule_recurrence")(
        *(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state=h0, output_final_state=True
    )
    close(o, ref_o.transpose(1, 2))
    close(state, ref_state)


@LENGTHS
@STATES
@pytest.mark.parametrize("HV", [2, 4], ids=["heads-2", "grouped-value-heads-4"])
def test_kda_matches_fla_naive_recurrent(T, with_state, HV):
    q, k, v = qkv(T=T, HV=HV)
    g = F.logsigmoid(torch.randn(2, T, HV, 16))
    beta = torch.rand(2, T, HV)
    h0 = torch.randn(2, HV, 16, 24) if with_state else None
    o, state = torch_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref = fla_naive("kda", "naive_recurrent_kda")(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    close(o, ref[0])
    close(state, ref[1])


def test_kda_gate_and_l2norm_in_kernel():
    """The gate fla's KDA layer computes in its kernel, and the in-kernel l2 norm (fla's eps 1e-6)."""
    q, k, v = qkv(T=70)
    raw = torch.randn(2, 70, 2, 16)
    A_log, dt_bias = torch.rand(2).log(), torch.randn(32)
    g = kda_gate(raw, A_log, dt_bias)
    torch.testing.assert_close(g, -A_log.exp()[:, None] * F.softplus(raw + dt_bias.view(2, 16)), atol=0, rtol=0)
    bounded = kda_gate(raw, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(bounded, -5.0 * torch.sigmoid(A_log.exp()[:, None] * (raw + dt_bias.view(2, 16))))
    k_raw = 3 * torch.randn(2, 70, 2, 16)
    beta = torch.rand(2, 70, 2)
    o, _ = torch_kda(q, k_raw, v, g, beta, use_qk_l2norm_in_kernel=True)
    unit = [x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k_raw)]
    close(o, fla_naive("kda", "naive_recurrent_kda")(*unit, v, g, beta)[0])


def test_packed_sequences_equal_one_by_one():
    """cu_seqlens (batch 1): each sequence from its own state, none seeing the one before."""
    lengths = [37, 1, 130]
    cu = torch.tensor([0, 37, 38, 168])
    q, k, v = qkv(B=1, T=168)
    g = F.logsigmoid(torch.randn(1, 168, 2, 16))
    h0 = torch.randn(3, 2, 16, 24)
    o, state = torch_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    start = 0
    for i, n in enumerate(lengths):
        end = start + n
        alone, alone_state = torch_gla(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                       initial_state=h0[i : i + 1], output_final_state=True)
        assert torch.equal(o[:, start:end], alone) and torch.equal(state[i : i + 1], alone_state)
        start = end


# ------------------------------------------------------------------ short convolution


def conv_by_hand(x, weight, bias, history, activation):
    """y_t = act(bias + sum_w weight[:, w] x_{t - W + 1 + w}), the left context from `history` [B, D, W - 1]."""
    W = weight.shape[1]
    padded = torch.cat([history.transpose(1, 2), x], dim=1)  # [B, W - 1 + T, D]
    y = torch.stack([(padded[:, t : t + W].transpose(1, 2) * weight).sum(-1) for t in range(x.shape[1])], 1)
    y = y + bias
    return F.silu(y) if activation else y


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_short_convolution_and_its_decode_step(T, activation):
    torch.manual_seed(T)
    x, weight, bias = torch.randn(2, T, 6), torch.randn(6, 4), torch.randn(6)
    state = torch.randn(2, 6, 4)
    y, final = torch_causal_conv1d(x, weight, bias, initial_state=state, output_final_state=True, activation=activation)
    close(y, conv_by_hand(x, weight, bias, state[..., 1:], activation))
    close(final, torch.cat([state, x.transpose(1, 2)], -1)[..., -4:])  # the last 4 inputs
    # decoding position by position from the same state gives the same outputs and state
    cache = state.clone()
    steps = [torch_causal_conv1d_update(x[:, t], cache, weight=weight, bias=bias, activation=activation)[0]
             for t in range(T)]
    close(torch.stack(steps, 1), y)
    close(cache, final)


# ------------------------------------------------------------------ norms and rotary (fla's torch twins)


def test_norms_match_fla_torch_references():
    pytest.importorskip("fla")
    from fla.modules.norm.layernorm import layer_norm_ref, rms_norm_ref

    from gated_attention.fla_cpu.modules.norms import torch_layer_norm, torch_rms_norm, torch_rms_norm_gated

    torch.manual_seed(0)
    x, residual, w, b, g = torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.randn(32), torch.randn(32), torch.randn(3, 5, 32)
    y, z = torch_rms_norm(x, w, None, residual=residual, prenorm=True)
    ref_y, ref_z = rms_norm_ref(x, w, None, residual=residual, prenorm=True)
    close(y, ref_y)
    close(z, ref_z)
    close(torch_layer_norm(x, w, b), layer_norm_ref(x, w, b))
    # the swish-gated RMSNorm of fla's linear-attention outputs: the norm times g * sigmoid(g)
    close(torch_rms_norm_gated(x, g, w, None, eps=1e-5), rms_norm_ref(x, w, None, eps=1e-5) * F.silu(g))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_fla_rotary_embedding_ref(interleaved):
    pytest.importorskip("fla")
    from fla.modules.rotary.ops import rotary_embedding_ref

    from gated_attention.fla_cpu.modules.rotary import torch_rotary_embedding

    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16)
    angles = torch.outer(torch.arange(20.0), 1.0 / 10000 ** (torch.arange(0, 12, 2) / 12))  # rotary dim 12 < 16
    cos, sin = angles.cos(), angles.sin()
    out = torch_rotary_embedding(x, cos, sin, interleaved=interleaved, seqlen_offsets=5)
    close(out, rotary_embedding_ref(x, cos[5:12], sin[5:12], interleaved=interleaved))
    # one offset per row; packed sequences count positions from their own start
    per_row = torch_rotary_embedding(x, cos, sin, interleaved=interleaved, seqlen_offsets=torch.tensor([0, 5]))
    close(per_row[1], out[1])
    packed = torch_rotary_embedding(x.reshape(1, 14, 3, 16), cos, sin, interleaved=interleaved,
                                    seqlen_offsets=torch.tensor([5, 5]), cu_seqlens=torch.tensor([0, 7, 14]))
    close(packed.view(2, 7, 3, 16), out)


# ------------------------------------------------------------------ softmax attention


@pytest.mark.parametrize("window", [None, 3])
def test_softmax_attention_matches_fla_naive_parallel_attn(window):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)  # 2 query heads per kv head
    o, weights = softmax_attention(q, k, v, window_size=window)
    ref_o, _ = fla_naive("attn", "naive_parallel_attn")(q, k, v, window_size=window)
    close(o, ref_o)
    assert weights.shape == (2, 4, 9, 9)
    close(weights.sum(-1), torch.ones(2, 4, 9))
    assert (weights.triu(1) == 0).all()


def test_softmax_attention_decode_padding_and_packing():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    full, full_weights = softmax_attention(q, k, v)
    # a decode step sees the whole cache: the last query of a full pass
    step, step_weights = softmax_attention(q[:, -1:], k, v)
    close(step, full[:, -1:])
    close(step_weights, full_weights[:, :, -1:])
    # left padding: padded keys get no weight, padded queries a zero output; the rest is the unpadded pass
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    padded, padded_weights = softmax_attention(q, k, v, attention_mask=mask)
    alone, _ = softmax_attention(q[:1, 2:], k[:1, 2:], v[:1, 2:])
    close(padded[:1, 2:], alone)
    assert (padded[0, :2] == 0).all() and (padded_weights[0, :, :, :2] == 0).all()
    close(padded[1], full[1])
    # packed sequences attend only within themselves
    packed, _ = softmax_attention(q.reshape(1, 12, 2, 8), k.reshape(1, 12, 2, 8), v.reshape(1, 12, 2, 8),
                                  cu_seqlens=torch.tensor([0, 6, 12]))
    close(packed.view(2, 6, 2, 8), full)


# ------------------------------------------------------------------ on a GPU: fla's own kernels against the torch paths


def _cuda_cases():
    """name -> (fla's kernel call, the torch path's call), each taking the same CUDA tensors."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.hgrn import chunk_hgrn, fused_recurrent_hgrn
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.retention import chunk_retention
    from fla.ops.simple_gla import chunk_simple_gla

    from gated_attention.fla_cpu.modules.norms import torch_rms_norm_gated

    def linear(H=4, K=64, V=64, T=300, B=2):
        q, k, v = qkv(B=B, T=T, H=H, K=K, V=V)
        return [x.cuda() for x in (q, k, v)], torch.randn(B, H, K, V, device="cuda")

    def gla():
        (q, k, v), h0 = linear()
        g = F.logsigmoid(torch.randn(*q.shape, device="cuda")) / 16
        return (lambda: chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True),
                lambda: torch_gla(q, k, v, g, initial_state=h0, output_final_state=True))

    def gla_recurrent():
        (q, k, v), h0 = linear(T=20)
        g = F.logsigmoid(torch.randn(*q.shape, device="cuda"))
        return (lambda: fused_recurrent_gla(q, k, v, gk=g, initial_state=h0, output_final_state=True),
                lambda: torch_gla(q, k, v, g, initial_state=h0, output_final_state=True))

    def simple_gla():
        (q, k, v), h0 = linear()
        g = F.logsigmoid(torch.randn(*q.shape[:3], device="cuda"))
        return (lambda: chunk_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True),
                lambda: torch_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True))

    def retention():
        (q, k, v), h0 = linear()
        return (lambda: chunk_retention(q, k, v, initial_state=h0, output_final_state=True),
                lambda: torch_retention(q, k, v, initial_state=h0, output_final_state=True))

    def hgrn(recurrent=False):
        x, g = torch.randn(2, 300, 128, device="cuda"), F.logsigmoid(torch.randn(2, 300, 128, device="cuda"))
        h0 = torch.randn(2, 128, device="cuda")
        kernel = fused_recurrent_hgrn if recurrent else chunk_hgrn
        return (lambda: kernel(x, g, initial_state=h0, output_final_state=True),
                lambda: torch_hgrn(x, g, initial_state=h0, output_final_state=True))

    def delta_rule():
        (q, k, v), h0 = linear()
        beta = torch.rand(*q.shape[:3], device="cuda")
        return (lambda: fused_recurrent_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True),
                lambda: torch_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True))

    def delta_rule_chunk_bf16():  # fla's chunk kernel refuses fp32 inputs
        (q, k, v), h0 = linear()
        q, k, v = (x.bfloat16() for x in (q, k, v))
        beta = torch.rand(*q.shape[:3], device="cuda").bfloat16()
        return (lambda: chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True),
                lambda: torch_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True))

    def kda(recurrent=False):
        (q, k, v), h0 = linear(T=20 if recurrent else 300)
        g = F.logsigmoid(torch.randn(*q.shape, device="cuda"))
        beta = torch.rand(*q.shape[:3], device="cuda")
        kernel = fused_recurrent_kda if recurrent else chunk_kda
        return (lambda: kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                lambda: torch_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True))

    def conv():
        x, w, b, h0 = (torch.randn(*s, device="cuda") for s in ((2, 300, 64), (64, 4), (64,), (2, 64, 4)))
        return (lambda: causal_conv1d(x, w, b, initial_state=h0, output_final_state=True, activation="silu"),
                lambda: torch_causal_conv1d(x, w, b, initial_state=h0, output_final_state=True, activation="silu"))

    def norm_gated():
        x, g, w = torch.randn(2, 300, 64, device="cuda"), torch.randn(2, 300, 64, device="cuda"), torch.randn(64, device="cuda")
        return (lambda: (rms_norm_gated(x, g, w, None, eps=1e-5),), lambda: (torch_rms_norm_gated(x, g, w, None, eps=1e-5),))

    return {"gla": gla, "gla-recurrent": gla_recurrent, "simple-gla": simple_gla, "retention": retention,
            "hgrn": hgrn, "hgrn-recurrent": lambda: hgrn(True), "delta-rule": delta_rule,
            "delta-rule-chunk-bf16": delta_rule_chunk_bf16, "kda": kda, "kda-recurrent": lambda: kda(True),
            "short-convolution": conv, "rms-norm-gated": norm_gated}


CUDA_CASES = ["gla", "gla-recurrent", "simple-gla", "retention", "hgrn", "hgrn-recurrent", "delta-rule",
              "delta-rule-chunk-bf16", "kda", "kda-recurrent", "short-convolution", "rms-norm-gated"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("case", CUDA_CASES)
def test_fla_kernels_on_cuda_match_the_torch_paths(case):
    """fla's kernel and the torch path on the same CUDA tensors, outputs and final states. Tolerance 5e-3
    (2e-2 for bf16 inputs): fla's kernels run fp32 matmuls on TF32 tensor cores (~1e-3 relative), and bf16
    inputs round to 2^-8 relative; the torch path computes in fp32."""
    pytest.importorskip("fla")
    torch.manual_seed(0)
    fla_call, torch_call = _cuda_cases()[case]()
    expected, actual = fla_call(), torch_call()
    tolerance = 2e-2 if "bf16" in case else 5e-3
    for a, e in zip(actual, expected):
        if e is not None:
            torch.testing.assert_close(a.float(), e.float(), atol=tolerance, rtol=tolerance)
