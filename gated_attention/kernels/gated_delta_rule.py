"""The gated delta rule: fla's Triton kernels on CUDA, a chunked torch implementation elsewhere.

Layout and meaning are fla's (`fla.ops.gated_delta_rule`). Per head, with the
state S `[K, V]` starting at `initial_state` (or zeros), for t = 1..T:

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T      (the delta rule: write the error)
    o_t = scale * S_t^T q_t

g is the log of the decay (g <= 0), beta in (0, 1) is the write strength, and
`scale` defaults to K ** -0.5. As in fla, q and k are used as given: the caller
l2-normalises them (or passes `use_qk_l2norm_in_kernel=True`).

The torch path follows the chunked (WY / UT-transform) form of fla's naive
chunk reference and transformers' `torch_chunk_gated_delta_rule`, with the
triangular solve replaced by a blocked inverse made of batched matmuls and the
diagonal scalings folded into [C, C] factors: see `chunked_gated_delta_rule`
and benchmarks/gdn_cpu.py.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .chunking import chunk_length, each_sequence, pad_time, to_chunks

logger = logging.get_logger(__name__)

CHUNK_SIZE = 64


def _fla_ops():
    """fla's chunk and fused-recurrent kernels, or None where fla is not installed.

    Imported here, not at module level: importing fla costs seconds, and this
    file is also copied into checkpoints as remote code, where an optional
    package may only be imported inside `try:`.
    """
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the gated delta rule over a sequence.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, HV, V]`; HV a multiple of H (grouped value heads: value head j
            reads q/k head j // (HV // H), as in fla and transformers).
        g: `[B, T, HV]`, log decay.
        beta: `[B, T, HV]`.
        scale: multiplies q; default K ** -0.5.
        initial_state: `[N, HV, K, V]`, N = B, or the number of packed sequences.
        output_final_state: also return the final state `[N, HV, K, V]` (fp32 on the torch path).
        cu_seqlens: `[N + 1]` start offsets of packed sequences (B must be 1); no
            state flows from one sequence into the next.
        use_qk_l2norm_in_kernel: l2-normalise q and k first (fla's eps, 1e-6).
        backend: "auto" (fla on CUDA tensors, torch elsewhere), "fla" or "torch".

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in v's dtype; final_state or None.
    """
    if backend not in ("auto", "fla", "torch"):
        raise ValueError(f"backend={backend!r} is not allowed; allowed values: 'auto', 'fla', 'torch'")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {q.shape[0]}")
    if scale is None:
        scale = k.shape[-1] ** -0.5

    # fla imports fine on a CPU-only machine and then fails inside its kernels, so the
    # device decides, never whether the import succeeds.
    use_fla = backend == "fla" or (backend == "auto" and q.device.type == "cuda")
    fla_ops = _fla_ops() if use_fla else None
    if use_fla and fla_ops is None:
        if backend == "fla":
            raise ImportError("backend='fla' needs flash-linear-attention: pip install flash-linear-attention")
        logger.warning_once(
            "gated_delta_rule: flash-linear-attention is not installed, using the torch implementation on CUDA "
            "(correct but much slower); pip install flash-linear-attention for the fused kernels."
        )
    if fla_ops is not None:
        chunk, fused_recurrent = fla_ops
        # fla's own layer uses the recurrent kernel for short inference calls (decode).
        kernel = fused_recurrent if (q.shape[1] <= 64 and not torch.is_grad_enabled()) else chunk
        return kernel(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
        )
    return torch_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2 normalisation: x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch path of `gated_delta_rule` (same arguments); differentiable, computes in fp32."""
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if cu_seqlens is not None:
        # Packed sequences: each runs alone from its own initial state (fla's semantics).
        return each_sequence(
            lambda q, k, v, g, beta, h0: torch_gated_delta_rule(
                q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
            ),
            cu_seqlens, [q, k, v, g, beta], initial_state, output_final_state,
        )
    if q.shape[1] == 1:
        return _recurrent_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    return chunked_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size
    )


def _recurrent_step(q, k, v, g, beta, scale, initial_state, output_final_state, l2):
    """One position (a decode step): the chunk path's arithmetic for a chunk of one, without its set-up.

    For C = 1 the chunk path's decay matrix, triangular inverse and key decay
    are all exactly 1, so what remains is the three matmuls below, on the
    same shapes and in the same order: the numbers are the chunk path's, bit
    for bit (tests/test_gated_delta_rule.py checks it), and the dozen small
    kernels that build the unit factors are skipped.
    """
    B, _, H, K = k.shape
    HV, V = v.shape[-2:]
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    BH, out_dtype = B * HV, v.dtype
    q, k, v = (x.to(torch.float32).reshape(BH, 1, x.shape[-1]) for x in (q, k, v))  # [BH, 1, D]
    g, beta = (x.to(torch.float32).reshape(BH, 1, 1) for x in (g, beta))
    if l2:
        q, k = l2norm(q), l2norm(k)
    decay = g.exp()
    state = q.new_zeros(BH, K, V) if initial_state is None else initial_state.to(torch.float32).reshape(BH, K, V)
    v_new = torch.baddbmm(beta * v, (beta * decay) * k, state, alpha=-1)  # beta (v - exp(g) S^T k)
    o = torch.baddbmm(torch.bmm(q * decay, state), q @ k.transpose(-1, -2), v_new, beta=scale, alpha=scale)
    state = torch.baddbmm(state * decay, k.transpose(-1, -2), v_new)
    final_state = state.view(B, HV, K, V) if output_final_state else None
    return o.view(B, 1, HV, V).to(out_dtype), final_state


def chunked_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, l2, chunk_size):
    """The chunked torch path for any T (`torch_gated_delta_rule` takes `_recurrent_step` for T = 1); positional
    arguments in the order of `torch_gated_delta_rule`'s, `l2` for `use_qk_l2norm_in_kernel`."""
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    out_dtype = v.dtype
    if T == 0:
        state = initial_state.float() if initial_state is not None else v.new_zeros(B, HV, K, V, dtype=torch.float32)
        return v.new_empty(B, 0, HV, V), state if output_final_state else None
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)

    # Padded steps have k = 0 and beta = 0, g = 0: they neither write nor decay the state.
    C, n = chunk_length(T, chunk_size)
    q, k, v, g, beta = (pad_time(x, n * C) for x in (q, k, v, g, beta))
    q, k, v = (to_chunks(x, n, C) for x in (q, k, v))  # [n, BH, C, D]
    g, beta = (to_chunks(x.unsqueeze(-1), n, C).squeeze(-1) for x in (g, beta))  # [n, BH, C]
    if l2:
        q, k = l2norm(q), l2norm(k)

    # c[i]: log decay from the chunk start through position i. Decays between positions
    # j <= i are exp(c_i - c_j); the upper triangle is set to -inf *before* exp, where
    # c_i - c_j > 0 could overflow.
    c = g.cumsum(-1)
    c_exp = c.exp()
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [n, BH, C, C]

    # Intra-chunk: the delta rule within a chunk is the unit-lower-triangular system
    # A [U | W] = [diag(beta) V | diag(beta exp(c)) K], A = I + tril(diag(beta) K K^T * decay, -1);
    # U are the values to write before the old state's prediction is subtracted, W the
    # keys through which the old state is read. The diagonal scalings are applied to the
    # [C, C] factors rather than to the [C, D] operands: fewer passes over memory.
    kk = k @ k.transpose(-1, -2)  # [n, BH, C, C]
    t_inv = unit_lower_inverse(kk * (decay * beta.unsqueeze(-1)))
    u = (t_inv * beta.unsqueeze(-2)) @ v  # [n, BH, C, V]
    w = (t_inv * (beta * c_exp).unsqueeze(-2)) @ k  # [n, BH, C, K]
    attn = (q @ k.transpose(-1, -2)) * decay  # causal intra-chunk scores (scale applied at the end)
    q_decayed = q * c_exp.unsqueeze(-1)  # reads the state left by the previous chunk
    k_decayed = (k * (c[..., -1:] - c).exp().unsqueeze(-1)).transpose(-1, -2)  # [n, BH, K, C], writes the next one
    chunk_decay = c_exp[..., -1, None, None]  # [n, BH, 1, 1]

    BH = B * HV
    if initial_state is None:
        state = q.new_zeros(BH, K, V)
    else:
        state = initial_state.to(torch.float32).reshape(BH, K, V)

    # Inter-chunk: the sequential part, five small matmuls per chunk. Each chunk's output
    # goes straight into its place in the [B, T, HV, V] result.
    out = q.new_empty(B, n, C, HV, V)
    for i in range(n):
        v_new = torch.baddbmm(u[i], w[i], state, alpha=-1)  # u - W S: the part S does not predict
        o = torch.baddbmm(torch.bmm(q_decayed[i], state), attn[i], v_new, beta=scale, alpha=scale)
        out[:, i] = o.view(B, HV, C, V).transpose(1, 2)
        state = torch.baddbmm(state * chunk_decay[i], k_decayed[i], v_new)
    o = out.view(B, n * C, HV, V)[:, :T]  # [B, T, HV, V]
    final_state = state.view(B, HV, K, V) if output_final_state else None
    return o.to(out_dtype), final_state


def unit_lower_inverse(m: torch.Tensor) -> torch.Tensor:
    """Inverse of `I + tril(m, -1)` for m `[..., C, C]`, C a power of two (the rest of m is not read).

    Merges diagonal blocks bottom-up, as fla's `solve_tril` kernel does:
    `[[A, 0], [M, D]]^-1 = [[A^-1, 0], [-D^-1 M A^-1, D^-1]]`. Same numbers as
    forward substitution up to rounding, in log2(C) rounds of batched matmuls,
    where `torch.linalg.solve_triangular` solves one small system at a time on
    the CPU and costs more than the rest of the torch path together.
    """
    *batch, C, _ = m.shape
    inv = m.new_ones(*batch, C, 1, 1)  # the 1x1 diagonal blocks of the inverse
    b = 1
    while b < C:
        pairs = C // (2 * b)
        diagonal_blocks = m.unflatten(-1, (pairs, 2 * b)).unflatten(-3, (pairs, 2 * b)).diagonal(dim1=-4, dim2=-2)
        lower = diagonal_blocks[..., b:, :b, :].movedim(-1, -3)  # [..., pairs, b, b]
        a, d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        top = torch.cat([a, torch.zeros_like(a)], dim=-1)
        bottom = torch.cat([-(d @ lower @ a), d], dim=-1)
        inv = torch.cat([top, bottom], dim=-2)  # [..., pairs, 2b, 2b]
        b *= 2
    return inv.squeeze(-3)
