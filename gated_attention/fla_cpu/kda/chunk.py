"""Kimi Delta Attention (the delta rule with a decay per key channel), in chunked torch.

Layout and meaning are fla's (`fla.ops.kda`). Per value head, with the state
S `[K, V]` starting at `initial_state` (or zeros), for t = 1..T:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = scale * S_t^T q_t

g `[B, T, HV, K]` is the log decay of each key channel, beta `[B, T, HV]`
the write strength, `scale` defaults to K ** -0.5. With g equal across
channels this is the gated delta rule (`gated_delta_rule`). fla's reference is
`fla/ops/kda/naive.py`.

The chunked form is the gated delta rule's (WY representation, the unit
lower-triangular system solved by `unit_lower_inverse`), with its [C, C]
decay matrix replaced by per-channel decayed scores (`gla.decayed_scores`):
`A_kk[i, j] = beta_i sum_d k_id k_jd exp(c_id - c_jd)` for j < i, and the
same between q and k for the output; the chunk length follows the decay as
in `gla` (64 down to 16 positions).

`kda_gate` is the decay fla's KDA layer computes in its kernel
(`use_gate_in_kernel=True`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.chunking import chunk_groups, chunk_span, delta_rule_scan, start_state, value_heads
from ...kernels.gated_delta_rule.chunk import l2norm, unit_lower_inverse
from ..chunking import chunk_size_for_decay, cumsum_rows, empty_output, over_sequences
from ..gla.chunk import SMALLEST_CHUNK, SPAN_LIMIT, decayed_scores

CHUNK_SIZE = 64


def kda_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None = None
) -> torch.Tensor:
    """fla's KDA decay from the raw gate g `[..., HV, K]`, in fp32.

    `-exp(A_log) * softplus(g + dt_bias)`, or with `lower_bound`
    `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` (A_log optional there);
    A_log `[HV]`, dt_bias `[HV * K]`.
    """
    HV, K = g.shape[-2:]
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(HV, K)
    if lower_bound is not None:
        if A_log is not None:
            g = A_log.float().exp().view(HV, 1) * g
        return lower_bound * torch.sigmoid(g)
    return -A_log.float().exp().view(HV, 1) * F.softplus(g)


def torch_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA over a sequence.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, HV, V]`; HV a multiple of H (value head j reads q/k head j // (HV // H)).
        g: `[B, T, HV, K]` log decay per key channel (see `kda_gate`).
        beta: `[B, T, HV]`.
        scale: multiplies q; default K ** -0.5.
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), N = B or the number of packed sequences.
        output_final_state: also return the final state (fp32, same layout).
        use_qk_l2norm_in_kernel: l2-normalise q and k first (fla's eps, 1e-6).
        state_v_first: fla's V-first state layout, which fla's layers use.
        cu_seqlens: `[N + 1]` bounds of packed sequences (B must be 1).

    Returns:
        `(o, final_state)`: o `[B, T, HV, V]` in v's dtype; final_state or None.
    """
    if scale is None:
        scale = k.shape[-1] ** -0.5
    return over_sequences(
        lambda q, k, v, g, beta, h: _chunked(
            q, k, v, g, beta, scale, h, output_final_state, use_qk_l2norm_in_kernel, chunk_size
        ),
        [q, k, v, g, beta], initial_state, output_final_state, state_v_first, cu_seqlens,
    )


def _chunked(q, k, v, g, beta, scale, initial_state, output_final_state, l2, chunk_size):
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    BH = B * HV
    state = start_state(q, initial_state, BH, K, V)
    if T == 0:
        return empty_output(v, state, K, output_final_state)
    q, k = value_heads(q, k, HV)
    C, factored = chunk_size_for_decay(g, chunk_size, SPAN_LIMIT, SMALLEST_CHUNK)
    n = -(-T // C)
    out = v.new_empty(B, n * C, HV, V)
    for first, m in chunk_groups(n, BH * C * max(C, K, V) * (1 if factored else K)):
        # Padded steps have k = 0 and beta = 0, g = 0: they neither write nor decay the state.
        qc, kc, vc, gc, bc = chunk_span([q, k, v, g, beta], first, m, C)  # [m, BH, C, D]; bc [m, BH, C]
        if l2:
            qc, kc = l2norm(qc), l2norm(kc)
        qc.mul_(scale)
        c = cumsum_rows(gc)  # log decay since the chunk start, per key channel
        c_exp = c.exp()

        # The intra-chunk delta rule, as in gated_delta_rule: T_inv = (I + strict_tril(diag(beta) A_kk))^-1;
        # U = T_inv diag(beta) V are the values to write before the old state's prediction is taken
        # off, W = T_inv diag(beta) (K exp(c)) the keys through which the old state is read.
        kk = decayed_scores(kc, kc, c, strict=True, factored=factored)
        t_beta = unit_lower_inverse(kk.mul_(bc.unsqueeze(-1))).mul_(bc.unsqueeze(-2))
        u = t_beta @ vc  # [m, BH, C, V]
        w = t_beta @ (kc * c_exp)  # [m, BH, C, K]
        attn = decayed_scores(qc, kc, c, factored=factored)  # [m, BH, C, C], causal
        q_decayed = qc.mul_(c_exp)
        k_decayed = (kc * (c[..., -1:, :] - c).exp_()).transpose(-1, -2)  # [m, BH, K, C]
        chunk_decay = c_exp[..., -1, :].unsqueeze(-1)  # [m, BH, K, 1]
        state = delta_rule_scan(out, state, first, u, w, attn, q_decayed, k_decayed, chunk_decay)
    return out[:, :T], state.view(B, HV, K, V) if output_final_state else None
