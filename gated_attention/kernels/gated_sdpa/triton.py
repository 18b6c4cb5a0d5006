"""Triton kernels for gated SDPA: `o = softmax(q k^T * scale) v * act(gate)`, optionally with sinks.

FlashAttention-2-style tiling with the gate fused into the epilogue. Shapes are
the public ones: q `[B, T, HQ, D]`, k/v `[B, S, HKV, D]`, gate `[B, T, HQ, D]`
(elementwise) or `[B, T, HQ]` (headwise), output `[B, T, HQ, D]`; with
`cu_seqlens` (int32 `[N+1]`) B is 1, T == S is the packed length and every
sequence attends only to itself. Any `HQ / HKV` (GQA/MQA): query head h reads
key/value head `h // (HQ / HKV)`.

Causal masking is bottom-right aligned: query i of T sees keys j <= i + S - T,
so a few new queries against a cache see the whole cache. Rows that see no key
(T > S) give zeros and a zero gradient, never NaN.

Sinks (GPT-OSS's learned per-head logit `s_h`, `[HQ]`): one more term in each
row's softmax denominator, with no value. The forward starts every row's online
softmax from it (m = s_h, l = 1) instead of from nothing, so the stored
log-sum-exp includes it and the dq/dk/dv kernels need no change; its gradient,
`-sum_t exp(s_h - lse_t) * delta_t`, is summed in torch from those two tensors.
A row that sees no key then has a finite lse (the sink's) and still outputs 0.

Numerics, the same as FlashAttention-2: scores and softmax statistics in fp32
(log2 units, `exp2`), the probabilities rounded to the input dtype before the
`p @ v` product, accumulators in fp32. The log-sum-exp (log2 units, +inf for a
row that sees nothing so that `exp2(s - lse)` is 0 there) is saved for the
backward pass.

Passes:
  forward   `fwd_kernel`: one program per (query block, batch*query head);
            stores the gated output, the ungated output O_u (only when a gate
            needs a gradient) and the log-sum-exp.
  decode    `_decode_split_kernel` + `_decode_combine_kernel`: for few queries
            against a long cache. Each program takes one slice of the keys for
            all queries of one key/value head (the GQA group's rows together,
            so each key is read once); the combine merges the slices by their
            log-sum-exp and applies the gate once, after the merge.
  backward  `_bwd_preprocess_kernel`: delta = rowsum(dO * O_gated) (= rowsum(dO_eff * O_u)),
            dO_eff = dO * act(gate), dgate = dO * O_u * act'(gate) (summed over
            D for a headwise gate). Then `bwd_dq_kernel` (per query block) and
            `bwd_dkdv_kernel` (per key block and key/value head, looping over
            the query heads of its group, so dk/dv accumulate in registers
            with no per-query-head copies and no atomics) run on dO_eff as in
            ungated attention.

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter's `tl.dot` mishandles
bf16, so every dot operand is first rounded to the input dtype and then
upcast to fp32 there.

Launch configurations: on a GPU each of the forward, dq and dk/dv kernels is
autotuned over a few tile shapes, keyed on the head dim, the flags and a
power-of-two bucket of the query and key lengths (so a 1k first call does not
fix the tiles for 16k). Autotuning costs seconds per new key, so with
GATED_ATTENTION_TRITON_AUTOTUNE=0 (the tests set it) each kernel launches with
the first config of its list alone; the interpreter always gets one config of
its own, since benchmarking needs a driver. Both variables are read at import.

triton is imported inside `try:` so that a checkpoint's remote-code copy of
this file loads where triton is missing (the dispatcher then falls back).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # dispatch.py catches this and uses the torch reference
    raise ImportError(f"triton is not available: {error}") from error


def _env_flag(name: str, default: str) -> bool:
    # Read once, like triton itself: `@triton.jit` and `@triton.autotune` decide at decoration time.
    return os.environ.get(name, default).lower() in ("1", "true", "on", "yes")


INTERPRET = _env_flag("TRITON_INTERPRET", "0")
AUTOTUNE = _env_flag("GATED_ATTENTION_TRITON_AUTOTUNE", "1")
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATION_CODES = {"sigmoid": 0, "ns_sigmoid": 1}  # the kernels' ACT constant, per activation name
GATE_NONE, GATE_ELEMENTWISE, GATE_HEADWISE = 0, 1, 2
LOG2E = 1.4426950408889634
INT32_MAX = 2**31 - 1

# Decode path: used when the query rows of one GQA group fit one tile and the
# keys can be cut into at least two slices of at least this many keys.
DECODE_MAX_ROWS = 64
DECODE_MIN_KEYS_PER_SPLIT = 64
DECODE_MAX_SPLITS = 64


# --------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------


def launch_configs(gpu: list[tuple[int, int, int, int]], interpret: tuple[int, int]) -> list:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates: all of `gpu` when autotuning, else its first;
    one config of its own under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": interpret[0], "BLOCK_N": interpret[1]}, num_warps=4, num_stages=1)]
    chosen = gpu if AUTOTUNE else gpu[:1]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in chosen]


# The first config of each list is the one launched without autotuning: a moderate tile that fits the shared
# memory of any GPU triton supports. The lines marked Hopper are larger tiles and deeper pipelines for
# sm_90's 228 KB of shared memory and wgmma (a config that does not fit a smaller GPU fails its trial launch
# and the autotuner drops it). The interpreter configs use different BLOCK_M and BLOCK_N so that the tests
# exercise the causal-boundary logic with unequal tiles, as on the GPU.
FWD_CONFIGS = launch_configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4),
     (128, 128, 8, 2), (128, 128, 4, 3), (128, 64, 4, 4)],  # Hopper
    (64, 32),
)
DQ_CONFIGS = launch_configs(
    [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 2), (128, 32, 4, 3),
     (128, 128, 8, 2), (128, 64, 8, 4)],  # Hopper
    (64, 32),
)
DKDV_CONFIGS = launch_configs(
    [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3),
     (32, 128, 4, 4), (64, 128, 8, 3)],  # Hopper
    (32, 64),
)
# T_BUCKET / S_BUCKET (see `seq_bucket`) are kernel arguments only so that the autotuner can key on them.
_AUTOTUNE_KEY = ["HEAD_DIM", "IS_CAUSAL", "IS_VARLEN", "GATE_MODE", "T_BUCKET", "S_BUCKET"]
SEQ_BUCKET_MIN, SEQ_BUCKET_MAX = 128, 16384


def seq_bucket(n: int) -> int:
    """A sequence length's autotune bucket: the next power of two, clamped to [128, 16384]."""
    return min(max(triton.next_power_of_2(max(n, 1)), SEQ_BUCKET_MIN), SEQ_BUCKET_MAX)


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _gate_act(z, ACT: tl.constexpr):
    """act(z) in fp32: sigmoid, or ns_sigmoid = 0.5 + 0.5 * sigmoid."""
    s = tl.sigmoid(z)
    if ACT == 1:
        s = 0.5 + 0.5 * s
    return s


@triton.jit
def _gate_act_grad(z, ACT: tl.constexpr):
    s = tl.sigmoid(z)
    d = s * (1.0 - s)
    if ACT == 1:
        d = 0.5 * d
    return d


@triton.jit
def _store_gated(o, o_ptrs, ou_ptrs, g_base, stride_gt, offs_m, offs_d, row_ok,
                 GATE_MODE: tl.constexpr, ACT: tl.constexpr, STORE_UNGATED: tl.constexpr):
    """Epilogue: store O_u (when the backward needs it) and o * act(gate); o is fp32 `[BLOCK_M, D]`."""
    if GATE_MODE != 0:
        if STORE_UNGATED:
            tl.store(ou_ptrs, o.to(ou_ptrs.dtype.element_ty), mask=row_ok[:, None])
        if GATE_MODE == 1:
            z = tl.load(g_base + offs_m[:, None] * stride_gt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            o = o * _gate_act(z.to(tl.float32), ACT)
        else:
            z = tl.load(g_base + offs_m * stride_gt, mask=row_ok, other=0.0)
            o = o * _gate_act(z.to(tl.float32), ACT)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, start, end, S, causal_shift,
               qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               ELEM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key blocks [start, end). MASKED: the block may hold keys past S or above the diagonal."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT_ptrs = k_base + offs_n[None, :] * stride_kt + offs_d[:, None]  # [D, BLOCK_N]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
        if MASKED:
            kT = tl.load(kT_ptrs, mask=offs_n[None, :] < S, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
        s = tl.dot(q, kT.to(DOT), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            valid = offs_n[None, :] < S
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that has seen no key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < S, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(ELEM).to(DOT), v.to(DOT), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=FWD_CONFIGS, key=_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["T", "S"])
def fwd_kernel(
    Q, K, V, G, O, OU, LSE, CU_SEQLENS, SINKS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    T, S, HQ, GROUP, qk_scale, T_BUCKET, S_BUCKET,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, GATE_MODE: tl.constexpr,
    ACT: tl.constexpr, STORE_UNGATED: tl.constexpr, HAS_SINKS: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // HQ
    i_h = pid_bh % HQ
    i_kvh = i_h // GROUP
    if IS_VARLEN:  # i_b indexes sequences; the tensors have B == 1
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        T = (tl.load(CU_SEQLENS + i_b + 1) - tl.load(CU_SEQLENS + i_b)).to(tl.int32)
        S = T
        q_base = Q + bos * stride_qt + i_h * stride_qh
        k_base = K + bos * stride_kt + i_kvh * stride_kh
        v_base = V + bos * stride_vt + i_kvh * stride_vh
        g_base = G + bos * stride_gt + i_h * stride_gh
        o_off = bos * stride_ot + i_h * stride_oh
        lse_base = LSE + i_h * stride_lh + bos
    else:
        b = i_b.to(tl.int64)
        q_base = Q + b * stride_qb + i_h * stride_qh
        k_base = K + b * stride_kb + i_kvh * stride_kh
        v_base = V + b * stride_vb + i_kvh * stride_vh
        g_base = G + b * stride_gb + i_h * stride_gh
        o_off = b * stride_ob + i_h * stride_oh
        lse_base = LSE + b * stride_lb + i_h * stride_lh
    if pid_m * BLOCK_M >= T:
        return
    ELEM: tl.constexpr = Q.dtype.element_ty

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT)

    if HAS_SINKS:  # the sink's term exp2(s - m) = 1 with m = s (log2 units), and no value
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + i_h)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    causal_shift = S - T  # bottom-right alignment: query i sees keys j <= i + S - T
    if IS_CAUSAL:
        # Keys below every row's diagonal need no mask; the rest up to the last row's diagonal do.
        hi = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0), S)
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + causal_shift + 1, 0), S) // BLOCK_N * BLOCK_N
    else:
        hi = S
        full_end = S // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, 0, full_end,
                               S, causal_shift, qk_scale, BLOCK_N, False, IS_CAUSAL, ELEM, DOT, PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, full_end, hi,
                               S, causal_shift, qk_scale, BLOCK_N, True, IS_CAUSAL, ELEM, DOT, PRECISION)

    # A row that saw no key has acc = 0 and l = 0: output 0, lse = +inf (so exp2(s - lse) = 0 in the backward).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(lse_base + offs_m, tl.where(seen, m_i + tl.math.log2(l_safe), float("inf")), mask=row_ok)
    o_ptrs = O + o_off + offs_m[:, None] * stride_ot + offs_d[None, :]
    ou_ptrs = OU + o_off + offs_m[:, None] * stride_ot + offs_d[None, :]
    _store_gated(o, o_ptrs, ou_ptrs, g_base, stride_gt, offs_m, offs_d, row_ok, GATE_MODE, ACT, STORE_UNGATED)


# --------------------------------------------------------------------------------------------
# Decode: split-KV forward with a log-sum-exp combine
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    Q, K, V, OP, LSEP,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    T, S, HKV, GROUP, keys_per_split, qk_scale,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key slice for all GROUP*T query rows of one key/value head.

    Row r is query head `i_kvh * GROUP + r // T`, position `r % T`. Writes the
    slice's normalised output `OP[b*HKV + i_kvh, split, r]` (fp32) and its
    log-sum-exp `LSEP` (-inf when the slice holds no visible key).
    """
    i_split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    num_splits = tl.num_programs(0)
    b = (pid_bh // HKV).to(tl.int64)
    i_kvh = pid_bh % HKV
    ELEM: tl.constexpr = Q.dtype.element_ty

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_r < GROUP * T
    t = offs_r % T
    head = i_kvh * GROUP + offs_r // T
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT)
    k_base = K + b * stride_kb + i_kvh * stride_kh
    v_base = V + b * stride_vb + i_kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = i_split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    # Every block may straddle the slice end or a row's diagonal: always masked.
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, t, offs_d, start, end,
                               end, S - T, qk_scale, BLOCK_N, True, IS_CAUSAL, ELEM, DOT, PRECISION)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    part = (pid_bh * num_splits + i_split).to(tl.int64) * BLOCK_M
    tl.store(OP + (part + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None])
    tl.store(LSEP + part + offs_r, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")))


@triton.jit
def _decode_combine_kernel(
    OP, LSEP, G, O, OU, LSE, SINKS,
    stride_gb, stride_gt, stride_gh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    T, HKV, GROUP, num_splits,
    HEAD_DIM: tl.constexpr, GATE_MODE: tl.constexpr, ACT: tl.constexpr, STORE_UNGATED: tl.constexpr,
    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Merge the key slices by their log-sum-exp (and the sink, a slice with no value), then apply the gate once."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // HKV).to(tl.int64)
    i_kvh = pid_bh % HKV
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_r < GROUP * T
    t = offs_r % T
    head = i_kvh * GROUP + offs_r // T

    first = pid_bh.to(tl.int64) * num_splits * BLOCK_M
    lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i_split in range(0, num_splits):
        lse_max = tl.maximum(lse_max, tl.load(LSEP + first + i_split * BLOCK_M + offs_r))
    if HAS_SINKS:
        sink = tl.load(SINKS + head, mask=row_ok, other=0.0)
        lse_max = tl.maximum(lse_max, sink)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        weight += tl.math.exp2(sink - lse_max_safe)
    for i_split in range(0, num_splits):
        part = first + i_split * BLOCK_M
        w = tl.math.exp2(tl.load(LSEP + part + offs_r) - lse_max_safe)
        acc += w[:, None] * tl.load(OP + (part + offs_r[:, None]) * HEAD_DIM + offs_d[None, :])
        weight += w

    seen = weight > 0.0
    w_safe = tl.where(seen, weight, 1.0)
    o = acc / w_safe[:, None]
    lse = tl.where(seen, lse_max_safe + tl.math.log2(w_safe), float("inf"))
    tl.store(LSE + b * stride_lb + head * stride_lh + t, lse, mask=row_ok)
    o_off = b * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :]
    # Rows differ in head and position: a per-row gate base, the position enters as `t`.
    if GATE_MODE == 2:
        g_base = G + b * stride_gb + head * stride_gh
    else:
        g_base = G + b * stride_gb + head[:, None] * stride_gh
    _store_gated(o, O + o_off, OU + o_off, g_base, stride_gt, t, offs_d, row_ok, GATE_MODE, ACT, STORE_UNGATED)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    OU, DO, G, DO_EFF, DELTA, DG,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_gb, stride_gt, stride_gh,
    stride_lb, stride_lh,
    T, HQ,
    HEAD_DIM: tl.constexpr, GATE_MODE: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Per row: delta = rowsum(dO_eff * O_u), dO_eff = dO * act(z), dz = dO * O_u * act'(z).

    Row-wise, so packed sequences need no cu_seqlens here (B == 1, T = all tokens).
    DO_EFF and DG have the contiguous layouts of O and G; DELTA that of LSE.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    i_h = pid_bh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    o_off = b * stride_ob + i_h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    o = tl.load(OU + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do_ptrs = DO + b * stride_dob + i_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :]
    do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    g_off = b * stride_gb + i_h * stride_gh
    if GATE_MODE == 1:
        g_ptrs = g_off + offs_m[:, None] * stride_gt + offs_d[None, :]
        z = tl.load(G + g_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(DG + g_ptrs, (do * o * _gate_act_grad(z, ACT)).to(DG.dtype.element_ty), mask=row_ok[:, None])
        do = (do * _gate_act(z, ACT)).to(DO_EFF.dtype.element_ty)
        tl.store(DO_EFF + o_off, do, mask=row_ok[:, None])
        do = do.to(tl.float32)
    elif GATE_MODE == 2:
        g_ptrs = g_off + offs_m * stride_gt
        z = tl.load(G + g_ptrs, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(DG + g_ptrs, (tl.sum(do * o, 1) * _gate_act_grad(z, ACT)).to(DG.dtype.element_ty), mask=row_ok)
        do = (do * _gate_act(z, ACT)[:, None]).to(DO_EFF.dtype.element_ty)
        tl.store(DO_EFF + o_off, do, mask=row_ok[:, None])
        do = do.to(tl.float32)
    # delta from the rounded dO_eff that the dq/dk kernels read, so that dp - delta cancels exactly.
    tl.store(DELTA + b * stride_lb + i_h * stride_lh + offs_m, tl.sum(do * o, 1), mask=row_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, start, end, S,
                  causal_shift, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  ELEM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < S, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < S, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        k = k.to(DOT)
        v = v.to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])  # lse = +inf on rows that see nothing: p = 0
        if MASKED:
            valid = offs_n[None, :] < S
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(ELEM).to(DOT), k, dq, input_precision=PRECISION)
    return dq


@triton.autotune(configs=DQ_CONFIGS, key=_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["T", "S"])
def bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    T, S, HQ, GROUP, sm_scale, qk_scale, T_BUCKET, S_BUCKET,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, GATE_MODE: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dq for one query block. DO (= dO_eff) and DQ have the contiguous layout of O."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // HQ
    i_h = pid_bh % HQ
    i_kvh = i_h // GROUP
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        T = (tl.load(CU_SEQLENS + i_b + 1) - tl.load(CU_SEQLENS + i_b)).to(tl.int32)
        S = T
        q_base = Q + bos * stride_qt + i_h * stride_qh
        k_base = K + bos * stride_kt + i_kvh * stride_kh
        v_base = V + bos * stride_vt + i_kvh * stride_vh
        o_off = bos * stride_ot + i_h * stride_oh
        l_off = i_h * stride_lh + bos
    else:
        b = i_b.to(tl.int64)
        q_base = Q + b * stride_qb + i_h * stride_qh
        k_base = K + b * stride_kb + i_kvh * stride_kh
        v_base = V + b * stride_vb + i_kvh * stride_vh
        o_off = b * stride_ob + i_h * stride_oh
        l_off = b * stride_lb + i_h * stride_lh
    if pid_m * BLOCK_M >= T:
        return
    ELEM: tl.constexpr = Q.dtype.element_ty

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    do_ptrs = DO + o_off + offs_m[:, None] * stride_ot + offs_d[None, :]
    do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0).to(DOT)
    lse = tl.load(LSE + l_off + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_off + offs_m, mask=row_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    causal_shift = S - T
    if IS_CAUSAL:
        hi = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + causal_shift, 0), S)
        full_end = tl.minimum(tl.maximum(pid_m * BLOCK_M + causal_shift + 1, 0), S) // BLOCK_N * BLOCK_N
    else:
        hi = S
        full_end = S // BLOCK_N * BLOCK_N
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, 0, full_end, S,
                       causal_shift, qk_scale, BLOCK_N, False, IS_CAUSAL, ELEM, DOT, PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, full_end, hi, S,
                       causal_shift, qk_scale, BLOCK_N, True, IS_CAUSAL, ELEM, DOT, PRECISION)
    tl.store(DQ + o_off + offs_m[:, None] * stride_ot + offs_d[None, :], (dq * sm_scale).to(ELEM), mask=row_ok[:, None])


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, stride_qt, stride_ot, DELTA, LSE, offs_n, offs_d,
                    start, end, T, causal_shift, qk_scale, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    ELEM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dk, dv `[BLOCK_N, D]` over query blocks [start, end) of one query head.

    Rows past T load q = dO = 0 and lse = +inf, so they add nothing; MASKED
    applies the causal diagonal.
    """
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_ot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q = q.to(DOT)
        do = do.to(DOT)
        lse = tl.load(LSE + l_base + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + l_base + offs_m, mask=row_ok, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(sT - lse[None, :])
        if MASKED:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_shift, pT, 0.0)
        dv = tl.dot(pT.to(ELEM).to(DOT), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(ELEM).to(DOT), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.autotune(configs=DKDV_CONFIGS, key=_AUTOTUNE_KEY)
@triton.jit(do_not_specialize=["T", "S"])
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    stride_dkb, stride_dkt, stride_dkh,
    T, S, HKV, GROUP, sm_scale, qk_scale, T_BUCKET, S_BUCKET,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, GATE_MODE: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk, dv for one key block of one key/value head, summed over the GROUP query heads that read it.

    DK and DV share one contiguous `[B, S, HKV, D]` layout (stride_dk*).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = pid_bh // HKV
    i_kvh = pid_bh % HKV
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        T = (tl.load(CU_SEQLENS + i_b + 1) - tl.load(CU_SEQLENS + i_b)).to(tl.int32)
        S = T
        q_base = Q + bos * stride_qt
        k_base = K + bos * stride_kt + i_kvh * stride_kh
        v_base = V + bos * stride_vt + i_kvh * stride_vh
        do_base = DO + bos * stride_ot
        l_base = bos
        dk_off = bos * stride_dkt + i_kvh * stride_dkh
    else:
        b = i_b.to(tl.int64)
        q_base = Q + b * stride_qb
        k_base = K + b * stride_kb + i_kvh * stride_kh
        v_base = V + b * stride_vb + i_kvh * stride_vh
        do_base = DO + b * stride_ob
        l_base = b * stride_lb
        dk_off = b * stride_dkb + i_kvh * stride_dkh
    if pid_n * BLOCK_N >= S:
        return
    ELEM: tl.constexpr = Q.dtype.element_ty

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < S
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=key_ok[:, None], other=0.0).to(DOT)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None], other=0.0).to(DOT)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    causal_shift = S - T
    if IS_CAUSAL:
        # Query i sees key j iff i >= j - (S - T): rows from `lo` see part of this block,
        # rows from `full_start` see all of it.
        lo = tl.minimum(tl.maximum(pid_n * BLOCK_N - causal_shift, 0), T) // BLOCK_M * BLOCK_M
        full_start = tl.minimum(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - causal_shift, 0), T)
        full_start = tl.cdiv(full_start, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_start = 0
    for i_g in range(0, GROUP):
        i_h = i_kvh * GROUP + i_g
        q_h = q_base + i_h * stride_qh
        do_h = do_base + i_h * stride_oh
        l_h = l_base + i_h * stride_lh
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_h, do_h, l_h, stride_qt, stride_ot, DELTA, LSE, offs_n, offs_d,
                                 lo, full_start, T, causal_shift, qk_scale, BLOCK_M, True, ELEM, DOT, PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_h, do_h, l_h, stride_qt, stride_ot, DELTA, LSE, offs_n, offs_d,
                                 full_start, T, T, causal_shift, qk_scale, BLOCK_M, False, ELEM, DOT, PRECISION)
    dk_ptrs = DK + dk_off + offs_n[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + dk_off + offs_n[:, None] * stride_dkt + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(ELEM), mask=key_ok[:, None])
    tl.store(dv_ptrs, dv.to(ELEM), mask=key_ok[:, None])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _batch_entry_extent(x: torch.Tensor) -> int:
    """Elements one batch entry of `x` spans: its farthest offset + 1, at least its contiguous size."""
    farthest = sum((n - 1) * stride for n, stride in zip(x.shape[1:], x.stride()[1:]))
    return max(farthest + 1, math.prod(x.shape[1:]))


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate_activation: str) -> str | None:
    """Why these inputs cannot run on the kernels, or None when they can."""
    if q.device.type != "cuda" and not INTERPRET:
        return f"tensors are on {q.device.type} (the Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not one of fp16, bf16, fp32"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}"
    if gate_activation not in ACTIVATION_CODES:
        return f"gate_activation {gate_activation!r} is not one of {tuple(ACTIVATION_CODES)}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q is {q.dtype} but k/v are {k.dtype}/{v.dtype}"
    # Batch and sequence starts are int64 in the kernels, offsets inside one batch entry (or packed sequence) int32.
    if max(_batch_entry_extent(x) for x in (q, k, v)) > INT32_MAX:
        return "one batch entry of q/k/v spans more than 2**31 - 1 elements (the kernels' offsets are int32)"
    return None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_dtype(dtype: torch.dtype):
    """The dtype of `tl.dot` operands: the input dtype, or fp32 under the interpreter (see the module docstring)."""
    return tl.float32 if INTERPRET else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs get true fp32 products (tf32 would be less accurate than torch's fp32 SDPA).
    return "ieee" if dtype == torch.float32 else None


def _gate_strides(gate: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if gate is None else (gate.stride(0), gate.stride(1), gate.stride(2))


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: only the slice count matters, not the occupancy


def decode_splits(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """Number of key slices for the split-KV decode path; 1 means the ordinary forward runs."""
    B, T, HQ, _ = q.shape
    S, HKV = k.shape[1], k.shape[2]
    if cu_seqlens is not None or T * (HQ // HKV) > DECODE_MAX_ROWS:
        return 1
    fill = triton.cdiv(2 * _num_sms(q.device), B * HKV)  # about two programs per SM
    return max(1, min(triton.cdiv(S, DECODE_MIN_KEYS_PER_SPLIT), fill, DECODE_MAX_SPLITS))


def _forward(q, k, v, gate, sinks, causal, scale, cu_seqlens, max_seqlen, act, store_ungated):
    """Returns (out, o_ungated, lse); o_ungated is out when there is no gate, None when not stored.
    `sinks`: None, or fp32 `[HQ]` in log2 units."""
    B, T, HQ, D = q.shape
    S, HKV = k.shape[1], k.shape[2]
    group = HQ // HKV
    gate_mode = GATE_NONE if gate is None else (GATE_ELEMENTWISE if gate.dim() == 4 else GATE_HEADWISE)
    out = torch.empty((B, T, HQ, D), dtype=q.dtype, device=q.device)
    o_u = torch.empty_like(out) if gate_mode != GATE_NONE and store_ungated else out
    lse = torch.empty((B, HQ, T), dtype=torch.float32, device=q.device)
    g = gate if gate is not None else out  # a dummy pointer when there is no gate
    qk_scale = scale * LOG2E
    meta = dict(HEAD_DIM=D, IS_CAUSAL=causal, GATE_MODE=gate_mode, ACT=ACTIVATION_CODES[act],
                STORE_UNGATED=store_ungated, HAS_SINKS=sinks is not None, DOT=_dot_dtype(q.dtype))
    sink_ptr = sinks if sinks is not None else lse  # a dummy pointer when there are none

    splits = decode_splits(q, k, cu_seqlens)
    if splits > 1:
        block_n = 16 if INTERPRET else 64
        keys_per_split = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
        splits = triton.cdiv(S, keys_per_split)
        rows = max(16, triton.next_power_of_2(T * group))
        o_part = torch.empty((B * HKV, splits, rows, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B * HKV, splits, rows), dtype=torch.float32, device=q.device)
        _decode_split_kernel[(splits, B * HKV)](
            q, k, v, o_part, lse_part, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            T, S, HKV, group, keys_per_split, qk_scale,
            HEAD_DIM=D, IS_CAUSAL=causal, DOT=_dot_dtype(q.dtype), PRECISION=_precision(q.dtype),
            BLOCK_M=rows, BLOCK_N=block_n, num_warps=4,
        )
        _decode_combine_kernel[(B * HKV,)](
            o_part, lse_part, g, out, o_u, lse, sink_ptr, *_gate_strides(gate), *out.stride()[:3], *lse.stride()[:2],
            T, HKV, group, splits,
            HEAD_DIM=D, GATE_MODE=gate_mode, ACT=meta["ACT"], STORE_UNGATED=store_ungated,
            HAS_SINKS=meta["HAS_SINKS"], BLOCK_M=rows, num_warps=4,
        )
    else:
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        rows = T if cu_seqlens is None else max_seqlen
        keys = S if cu_seqlens is None else max_seqlen
        grid = lambda META: (triton.cdiv(rows, META["BLOCK_M"]), n_seq * HQ)  # noqa: E731
        fwd_kernel[grid](
            q, k, v, g, out, o_u, lse, cu_seqlens, sink_ptr,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_gate_strides(gate), *out.stride()[:3],
            *lse.stride()[:2], T, S, HQ, group, qk_scale, seq_bucket(rows), seq_bucket(keys),
            IS_VARLEN=cu_seqlens is not None, PRECISION=_precision(q.dtype), **meta,
        )
    return out, (o_u if store_ungated or gate_mode == GATE_NONE else None), lse


def _backward(do, q, k, v, gate, sinks, o_u, lse, causal, scale, cu_seqlens, max_seqlen, act):
    B, T, HQ, D = q.shape
    S, HKV = k.shape[1], k.shape[2]
    group = HQ // HKV
    gate_mode = GATE_NONE if gate is None else (GATE_ELEMENTWISE if gate.dim() == 4 else GATE_HEADWISE)
    do = _last_dim_contiguous(do)
    delta = torch.empty_like(lse)
    if gate_mode == GATE_NONE:
        do_eff, dgate = do, None
    else:
        do_eff = torch.empty((B, T, HQ, D), dtype=q.dtype, device=q.device)
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 64
    g = gate if gate is not None else o_u
    dg = dgate if dgate is not None else o_u
    _bwd_preprocess_kernel[(triton.cdiv(T, block), B * HQ)](
        o_u, do, g, do_eff, delta, dg, *o_u.stride()[:3], *do.stride()[:3], *_gate_strides(gate), *lse.stride()[:2],
        T, HQ, HEAD_DIM=D, GATE_MODE=gate_mode, ACT=ACTIVATION_CODES[act], BLOCK_M=block, num_warps=4,
    )
    if do_eff.stride() != o_u.stride():  # the dq/dk/dv kernels read dO_eff with O's (contiguous) layout
        do_eff = do_eff.contiguous()
    # d/ds_h: the sink's probability exp(s_h - lse_t) times -delta_t (d O_u / d s_h = -p_sink O_u), summed over rows.
    dsinks = None if sinks is None else -(torch.exp2(sinks[None, :, None] - lse) * delta).sum(dim=(0, 2))

    dq = torch.empty((B, T, HQ, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, S, HKV, D), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    rows_q = T if cu_seqlens is None else max_seqlen
    rows_k = S if cu_seqlens is None else max_seqlen
    common = dict(HEAD_DIM=D, IS_CAUSAL=causal, IS_VARLEN=cu_seqlens is not None, GATE_MODE=gate_mode,
                  DOT=_dot_dtype(q.dtype), PRECISION=_precision(q.dtype))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dq.stride()[:3], *lse.stride()[:2])
    scalars = (scale, scale * LOG2E, seq_bucket(rows_q), seq_bucket(rows_k))  # sm_scale, qk_scale, T/S_BUCKET
    bwd_dq_kernel[lambda META: (triton.cdiv(rows_q, META["BLOCK_M"]), n_seq * HQ)](
        q, k, v, do_eff, lse, delta, dq, cu_seqlens, *strides, T, S, HQ, group, *scalars, **common,
    )
    bwd_dkdv_kernel[lambda META: (triton.cdiv(rows_k, META["BLOCK_N"]), n_seq * HKV)](
        q, k, v, do_eff, lse, delta, dk, dv, cu_seqlens, *strides, *dk.stride()[:3],
        T, S, HKV, group, *scalars, **common,
    )
    return dq, dk, dv, dgate, dsinks


class GatedSDPAFunction(torch.autograd.Function):
    """Differentiable gated SDPA on the Triton kernels; see the module docstring for shapes."""

    @staticmethod
    def forward(ctx, q, k, v, gate, sinks, causal: bool, scale: float, cu_seqlens, act: str, needs_grad: bool):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        sinks_log2 = None if sinks is None else sinks.detach().float().contiguous() * LOG2E
        if gate is not None:
            # dgate is written with the gate's strides; an expanded (input-independent) gate is materialised.
            gate = gate.contiguous()
        max_seqlen = 0
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
        out, o_u, lse = _forward(q, k, v, gate, sinks_log2, causal, scale, cu_seqlens, max_seqlen, act,
                                 store_ungated=needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, k, v, gate, sinks_log2, o_u, lse, cu_seqlens)
            ctx.causal, ctx.scale, ctx.max_seqlen, ctx.act = causal, scale, max_seqlen, act
            ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, gate, sinks_log2, o_u, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dgate, dsinks = _backward(do, q, k, v, gate, sinks_log2, o_u, lse, ctx.causal, ctx.scale,
                                              cu_seqlens, ctx.max_seqlen, ctx.act)
        dsinks = None if dsinks is None else dsinks.to(ctx.sinks_dtype)
        return dq, dk, dv, dgate, dsinks, None, None, None, None, None


def gated_sdpa_triton(q, k, v, gate=None, *, causal=True, scale=None, cu_seqlens=None, gate_activation="sigmoid",
                      sinks=None):
    """The Triton path of `gated_sdpa` (inputs already validated by the dispatcher)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, gate, sinks))
    return GatedSDPAFunction.apply(q, k, v, gate, sinks, causal, scale, cu_seqlens, gate_activation, needs_grad)
