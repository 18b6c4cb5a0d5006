"""Analysis metrics on hand-made arrays; every expected value is worked out in the comments.

Conventions (docs/architecture.md, "Metric definitions"): m[l] for residual positions l = 0..L (0 = embeddings,
l = output of layer l); attention layers f are 1-based, their input is m[f-1].
"""

import math

import numpy as np
import pytest
import torch

from gated_attention.analysis import metrics
from gated_attention.analysis.interventions import (attention_inputs, connection_edits, deletion_edits, endpoint_edits,
                                                    set_mean_edits)

nan = float("nan")

# L = 8, attention layers 4 and 8 -> pre-attention positions p = 3, 7.
#               l:  0  1  2  3  4  5  6  7  8
M_HYBRID = np.array([1, 2, 3, 8, 5, 2, 7, 6, 9], dtype=float)
FA = [4, 8]


def test_attention_blocks():
    # B_f runs from just after the previous attention layer (layer 1 if none) to f-1;
    # an empty range (adjacent attention layers, or f = 1) leaves the block {f-1}.
    assert metrics.attention_blocks([4, 8]) == {4: [1, 2, 3], 8: [5, 6, 7]}
    assert metrics.attention_blocks([1, 3, 4, 7]) == {1: [0], 3: [2], 4: [3], 7: [5, 6]}
    assert metrics.attention_blocks([]) == {}


def test_sink_spike_alignment():
    # B_4 = {1,2,3}: m = 2,3,8 -> argmax at 3 = f-1, a hit.
    # B_8 = {5,6,7}: m = 2,7,6 -> argmax at 6 != 7, a miss.  1 hit of 2.
    assert metrics.sink_spike_alignment(M_HYBRID, FA) == 0.5
    # One-layer blocks always hit: a dense model (every layer is attention).
    assert metrics.sink_spike_alignment(np.arange(5.0), [1, 2, 3, 4]) == 1.0
    # A tie goes to the earlier layer: not a hit.
    assert metrics.sink_spike_alignment(np.array([0, 5, 5.0]), [2]) == 1.0  # B_2 = {1}: a single layer
    assert metrics.sink_spike_alignment(np.array([0, 5, 5, 1.0]), [3]) == 0.0  # B_3 = {1, 2}, tie at 1 and 2
    assert math.isnan(metrics.sink_spike_alignment(M_HYBRID, []))
    assert math.isnan(metrics.sink_spike_alignment(np.array([1, nan, 3.0]), [2]))


def test_random_layer_baseline():
    assert metrics.random_layer_baseline(FA) == pytest.approx(1 / 3)  # |B_4| = |B_8| = 3
    assert metrics.random_layer_baseline([1, 3, 4, 7]) == pytest.approx((1 + 1 + 1 + 0.5) / 4)
    assert math.isnan(metrics.random_layer_baseline([]))


def test_peak_excess():
    # f=4: log2(m[3] / max(m[1], m[2])) = log2(8/3); f=8: log2(m[7] / max(m[5], m[6])) = log2(6/7).
    assert metrics.peak_excess(M_HYBRID, FA) == pytest.approx([math.log2(8 / 3), math.log2(6 / 7)])
    # Twice the strongest earlier layer is +1.
    assert metrics.peak_excess(np.array([9, 1, 2, 4.0]), [3]) == pytest.approx([1.0])
    # Undefined for a one-layer block: f=5 follows f=4 directly (B_5 = {4}); f=1 has B_1 = {0}.
    out = metrics.peak_excess(M_HYBRID, [1, 4, 5])
    assert math.isnan(out[0]) and out[1] == pytest.approx(math.log2(8 / 3)) and math.isnan(out[2])
    # Undefined where the log is: a zero magnitude.
    assert math.isnan(metrics.peak_excess(np.array([0, 0, 0, 4.0]), [3])[0])


def test_inter_spike_retention_and_activation():
    # p = 3, 7; J_1 = {4, 5, 6} minus attention-layer outputs {4, 8} = {5, 6}.
    # Floor min(m[3], m[7]) = min(8, 6) = 6: min(1, 2/6) = 1/3, min(1, 7/6) = 1 (clipped).
    assert metrics.inter_spike_retention(M_HYBRID, FA) == pytest.approx((1 / 3 + 1) / 2)
    # A_ISP: mean of m[5], m[6] = (2 + 7) / 2.
    assert metrics.inter_spike_activation(M_HYBRID, FA) == pytest.approx(4.5)


@pytest.mark.parametrize(
    "m, layers",
    [
        pytest.param(M_HYBRID, [4], id="one-attention-layer"),
        pytest.param(M_HYBRID, [4, 5], id="adjacent-attention-layers"),  # J_1 empty
        pytest.param(np.arange(5.0), [1, 2, 3, 4], id="dense-model"),
        pytest.param(M_HYBRID, [], id="no-attention-layer"),
    ],
)
def test_inter_spike_metrics_undefined(m, layers):
    assert math.isnan(metrics.inter_spike_retention(m, layers))
    assert math.isnan(metrics.inter_spike_activation(m, layers))


def test_inter_spike_retention_zero_endpoint_is_undefined():
    m = M_HYBRID.copy()
    m[7] = 0.0
    assert math.isnan(metrics.inter_spike_retention(m, FA))
    assert metrics.inter_spike_activation(m, FA) == pytest.approx(4.5)  # unnormalised: still defined


def test_layer_out_of_range_raises():
    with pytest.raises(ValueError, match="1..8"):
        metrics.sink_spike_alignment(M_HYBRID, [9])
    with pytest.raises(ValueError):
        metrics.inter_spike_retention(M_HYBRID, [0, 4])


# Two heads, T = 4 (rows = queries, causal).
HEAD_A = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0.1, 0.8, 0.1, 0], [0.1, 0.6, 0.1, 0.2]])
HEAD_B = np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 1, 0]])


def test_consensus_sink():
    # Received from later queries / number of them:
    #   head A: t0 (0.5+0.1+0.1)/3 = 0.2333, t1 (0.8+0.6)/2 = 0.7,  t2 0.1/1 = 0.1
    #   head B: t0 (1+0.5+0)/3   = 0.5,    t1 (0.5+0)/2   = 0.25, t2 1/1   = 1.0
    # head mean: t0 0.3667, t1 0.475, t2 0.55 -> token 2. (Without the division by the
    # number of queries t0 would win: 1.1 vs 0.95 vs 0.55.)
    layer1 = np.stack([HEAD_A, HEAD_B])
    assert metrics.consensus_sink([layer1]) == 2
    # Averaged with a layer of two A heads (0.2333, 0.7, 0.1): t0 0.3, t1 0.5875, t2 0.325 -> token 1.
    assert metrics.consensus_sink([layer1, np.stack([HEAD_A, HEAD_A])]) == 1


def test_consensus_sink_undefined():
    assert metrics.consensus_sink([]) == -1
    assert metrics.consensus_sink([np.ones((2, 1, 1))]) == -1  # T = 1: no later query


def test_first_token_attention_and_f_attn():
    # Mean over queries q >= 1 of A[q, 0]: head A (0.5+0.1+0.1)/3, head B (1+0.5+0)/3.
    per_head = metrics.first_token_attention([np.stack([HEAD_A, HEAD_B])])
    np.testing.assert_allclose(per_head, [[0.7 / 3, 0.5]])
    assert metrics.f_attn([np.stack([HEAD_A, HEAD_B])]) == pytest.approx((0.7 / 3 + 0.5) / 2)
    assert math.isnan(metrics.f_attn([]))


def test_first_token_importance_and_sink_rate():
    # Gu et al. 2024: mean over all T = 4 queries, query 0 included, of A[q, 0]:
    # head A (1 + 0.5 + 0.1 + 0.1) / 4 = 0.425, head B (1 + 1 + 0.5 + 0) / 4 = 0.625.
    importance = metrics.first_token_importance([np.stack([HEAD_A, HEAD_B])])
    np.testing.assert_allclose(importance, [[0.425, 0.625]])
    # Head A's F-Attn (queries q >= 1) is 0.7 / 3 = 0.233, below 0.3; counting query 0 puts it above.
    assert metrics.sink_rate(importance) == 1.0
    assert metrics.sink_rate(importance, epsilon=0.5) == 0.5  # head B only
    assert metrics.sink_rate(importance, epsilon=0.625) == 0.0  # "exceeds": equal is no sink
    # The fraction per layer, averaged over layers (1/L sum_l 1/H sum_h): layer 1 has 1 of 2 heads, layer 2 (one head
    # fewer, NaN-padded) 1 of 1: (0.5 + 1) / 2 = 0.75, not the pooled 2 of 3.
    assert metrics.sink_rate(np.array([[0.5, 0.1], [0.9, nan]])) == 0.75
    assert math.isnan(metrics.sink_rate(np.zeros((0, 0))))
    assert metrics.first_token_importance([]).shape == (0, 0)


def test_m_act():
    # residual [L+1 = 3, T = 2, D = 2]
    x = np.array([[[1, -2], [0, 1]], [[3, 0], [-4, 1]], [[0, 10], [1, 1]]], dtype=float)
    np.testing.assert_array_equal(metrics.token_max_abs(x), [[2, 1], [3, 4], [10, 1]])
    np.testing.assert_array_equal(metrics.m_act_per_layer(x), [2, 4, 10])
    assert metrics.m_act(x) == 7.0  # mean over layers 1..2 of (4, 10); the embeddings (2) are excluded


def test_gate_statistics():
    scores = np.array([0.05, 0.2, 0.5, 0.9])
    stats = metrics.gate_statistics(scores)
    assert stats["mean"] == pytest.approx(0.4125)
    assert stats["frac_below_0.1"] == 0.25
    assert stats["frac_below_0.5"] == 0.5  # 0.5 itself is not below 0.5
    assert math.isnan(metrics.gate_statistics(np.array([]))["mean"])
    # [N = 2, H = 2, W = 1]: head 0 sees 0.05, 0.5; head 1 sees 0.2, 0.9.
    per_head = metrics.gate_statistics_per_head(scores.reshape(2, 2, 1))
    np.testing.assert_allclose(per_head["mean"], [0.275, 0.55])
    np.testing.assert_allclose(per_head["frac_below_0.1"], [0.5, 0.0])
    np.testing.assert_allclose(per_head["frac_below_0.5"], [0.5, 0.5])


def test_bootstrap_ci():
    assert metrics.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)  # no spread, no interval
    mean, low, high = metrics.bootstrap_ci([0.0, 1.0, 2.0, 3.0, nan])
    assert mean == 1.5 and 0.0 <= low < 1.5 < high <= 3.0
    assert metrics.bootstrap_ci([0.0, 1.0, 2.0, 3.0]) == metrics.bootstrap_ci([0.0, 1.0, 2.0, 3.0])  # seeded
    one = metrics.bootstrap_ci([nan, 4.0])
    assert one[0] == 4.0 and math.isnan(one[1]) and math.isnan(one[2])
    assert all(math.isnan(v) for v in metrics.bootstrap_ci([nan]))


# First-token trajectory z[l] for L = 5, attention layers 2 and 5 -> p = 1, 4 (`attention_inputs`).
Z = torch.tensor(
    [
        [0.0, 0.0, 0.0],
        [0.0, -5.0, 1.0],  # p = 1: |z| top-1 = {1}, top-2 = {1, 2}
        [1.0, -2.0, 0.0],
        [4.0, -6.0, 2.0],
        [-2.0, 1.0, 7.0],  # p = 4: top-1 = {2}, top-2 = {0, 2}
        [0.0, 0.0, 0.0],
    ]
)


def _plan(edits):
    return {layer: (c.tolist(), v.tolist()) for layer, (c, v) in edits.items()}


def test_deletion_edits():
    assert _plan(deletion_edits(Z, [1, 4], k=1)) == {1: ([1], [0.0]), 4: ([2], [0.0])}
    assert _plan(deletion_edits(Z, [1, 4], k=2)) == {1: ([1, 2], [0.0, 0.0]), 4: ([0, 2], [0.0, 0.0])}


def test_set_mean_edits():
    # The coordinates chosen on this input's z (as deletion's), each set to its mean over the inputs.
    mean = torch.arange(18, dtype=torch.float64).reshape(6, 3)  # [L+1, D]
    assert _plan(set_mean_edits(Z, mean, [1, 4], k=1)) == {1: ([1], [4.0]), 4: ([2], [14.0])}
    assert _plan(set_mean_edits(Z, mean, [1, 4], k=2)) == {1: ([1, 2], [4.0, 5.0]), 4: ([0, 2], [12.0, 14.0])}
    assert set_mean_edits(Z, mean, [1, 4], k=1)[1][1].dtype == Z.dtype  # in z's dtype, as the model's state


def test_edits_at_chosen_residual_positions():
    # X[l] for l = 2 and 3, not the attention inputs: top-1 of |z[2]| = |(1, -2, 0)| is 1, of |z[3]| = |(4, -6, 2)| is 1.
    mean = torch.arange(18, dtype=torch.float64).reshape(6, 3)
    assert attention_inputs([5, 2, 2]) == [1, 4]  # p = f - 1, ascending, once each
    assert _plan(set_mean_edits(Z, mean, [3, 2, 3], k=1)) == {2: ([1], [7.0]), 3: ([1], [10.0])}
    assert _plan(deletion_edits(Z, [3, 2], k=2)) == {2: ([0, 1], [0.0, 0.0]), 3: ([0, 1], [0.0, 0.0])}
    assert _plan(endpoint_edits(Z, [3, 2], 1, "set-mean")) == {2: ([1], [-2.0]), 3: ([1], [-6.0])}


def test_connection_edits():
    # k = 1: C = {1} u {2} = {1, 2}. Endpoints keep z: p=1 -> (-5, 1), p=4 -> (1, 7).
    # Between (l = 2, 3): s = sign(z(1)) = (-1, +1), |z(1)| = (5, 1); value s * max(|z(1)|, s * z(l)):
    #   l=2, z = (-2, 0): (-max(5, 2), max(1, 0)) = (-5, 1)     (held at the spike's floor)
    #   l=3, z = (-6, 2): (-max(5, 6), max(1, 2)) = (-6, 2)     (already beyond the floor: unchanged)
    assert _plan(connection_edits(Z, [1, 4], k=1)) == {
        1: ([1, 2], [-5.0, 1.0]),
        4: ([1, 2], [1.0, 7.0]),
        2: ([1, 2], [-5.0, 1.0]),
        3: ([1, 2], [-6.0, 2.0]),
    }
    # k = 3 adds coordinate 0, whose spike z_0(1) = 0 takes s = +1: max(0, z_0(l)) = 1 at l=2, 4 at l=3.
    # (With s = -1 it would be -max(0, -1) = 0 at l=2.)
    plan = _plan(connection_edits(Z, [1, 4], k=3))
    assert plan[2] == ([0, 1, 2], [1.0, -5.0, 1.0]) and plan[3] == ([0, 1, 2], [4.0, -6.0, 2.0])
    # A single attention layer has no interval: connection only pins the endpoint.
    assert _plan(connection_edits(Z, [4], k=1)) == {4: ([2], [7.0])}


def test_endpoint_edits_pin_what_the_intervention_touches():
    assert _plan(endpoint_edits(Z, [1, 4], 1, "deletion")) == {1: ([1], [-5.0]), 4: ([2], [7.0])}
    assert _plan(endpoint_edits(Z, [1, 4], 1, "set-mean")) == {1: ([1], [-5.0]), 4: ([2], [7.0])}
    assert _plan(endpoint_edits(Z, [1, 4], 1, "connection")) == {1: ([1, 2], [-5.0, 1.0]), 4: ([1, 2], [1.0, 7.0])}
