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
triangular system solved in one batched call and the diagonal scalings folded
into [C, C] factors: see `chunked_gated_delta_rule` and benchmarks/fla_cpu.py.
A single position (a decode step) takes a recurrent step instead.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..chunking import chunk_groups, chunk_length, chunk_span, delta_rule_scan, each_sequence, start_state, value_heads

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
    """The torch path of `gated_delta_rule` (same arguments); differentiable, computes in fp32.

    g may be None here: no decay (DeltaNet's delta rule), without computing decay factors of 1.
    """
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
        if g is None:
            g = beta.new_zeros(beta.shape, dtype=torch.float32)
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
    q, k = value_heads(q, k, HV)
    BH, out_dtype = B * HV, v.dtype
    q, k, v = (x.to(torch.float32).reshape(BH, 1, x.shape[-1]) for x in (q, k, v))  # [BH, 1, D]
    g, beta = (x.to(torch.float32).reshape(BH, 1, 1) for x in (g, beta))
    if l2:
        q, k = l2norm(q), l2norm(k)
    decay = g.exp()
    state = start_state(q, initial_state, BH, K, V)
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
    if T == 0:
        state = initial_state.float() if initial_state is not None else v.new_zeros(B, HV, K, V, dtype=torch.float32)
        return v.new_empty(B, 0, HV, V), state if output_final_state else None
    q, k = value_heads(q, k, HV)
    BH = B * HV
    state = start_state(q, initial_state, BH, K, V)
    C, n = chunk_length(T, chunk_size)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    out = v.new_empty(B, n * C, HV, V)
    for first, m in chunk_groups(n, BH * C * max(C, K, V)):
        # Padded steps have k = 0 and beta = 0, g = 0: they neither write nor decay the state.
        qc, kc, vc, bc = chunk_span([q, k, v, beta], first, m, C)  # [m, BH, C, D]; bc [m, BH, C]
        if l2:
            qc, kc = l2norm(qc), l2norm(kc)
        kk = kc @ kc.transpose(-1, -2)  # [m, BH, C, C]
        attn = qc @ kc.transpose(-1, -2)  # causal intra-chunk scores once masked (scale applied at the end)

        if g is None:  # the delta rule without decay (DeltaNet): every decay factor below is 1
            t_beta = unit_lower_inverse(kk.mul_(bc.unsqueeze(-1))).mul_(bc.unsqueeze(-2))
            u, w = t_beta @ vc, t_beta @ kc
            attn.masked_fill_(upper, 0.0)
            q_decayed, k_decayed, chunk_decay = qc, kc.transpose(-1, -2), None
        else:
            # c[i]: log decay from the chunk start through position i. Decays between positions
            # j <= i are exp(c_i - c_j); the upper triangle is set to -inf *before* exp, where
            # c_i - c_j > 0 could overflow.
            (c,) = chunk_span([g], first, m, C)
            c = c.cumsum(-1)  # [m, BH, C]
            c_exp = c.exp()
            decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()  # [m, BH, C, C]

            # Intra-chunk: the delta rule within a chunk is the unit-lower-triangular system
            # A [U | W] = [diag(beta) V | diag(beta exp(c)) K], A = I + tril(diag(beta) K K^T * decay, -1);
            # U are the values to write before the old state's prediction is subtracted, W the
            # keys through which the old state is read. The diagonal scalings are applied to the
            # [C, C] factors rather than to the [C, D] operands: fewer passes over memory.
            t_inv = unit_lower_inverse(kk * (decay * bc.unsqueeze(-1)))
            u = (t_inv * bc.unsqueeze(-2)) @ vc  # [m, BH, C, V]
            w = (t_inv * (bc * c_exp).unsqueeze(-2)) @ kc  # [m, BH, C, K]
            attn.mul_(decay)
            q_decayed = qc * c_exp.unsqueeze(-1)  # reads the state left by the previous chunk
            k_decayed = (kc * (c[..., -1:] - c).exp().unsqueeze(-1)).transpose(-1, -2)  # [m, BH, K, C], writes the next
            chunk_decay = c_exp[..., -1, None, None]  # [m, BH, 1, 1]

        # Inter-chunk: the sequential part, chunk after chunk.
        state = delta_rule_scan(out, state, first, u, w, attn, q_decayed, k_decayed, chunk_decay, scale=scale)
    final_state = state.view(B, HV, K, V) if output_final_state else None
    return out[:, :T], final_state


def unit_lower_inverse(m: torch.Tensor) -> torch.Tensor:
    """Inverse of `I + tril(m, -1)` for m `[..., C, C]` (the diagonal and the upper triangle of m are not read).

    One batched unit-lower-triangular solve against the identity: a single call
    for every chunk and head, exact up to the solve's own rounding.
    """
    C = m.shape[-1]
    eye = torch.eye(C, dtype=m.dtype, device=m.device).expand_as(m)
    return torch.linalg.solve_triangular(m, eye, upper=False, unitriangular=True)
