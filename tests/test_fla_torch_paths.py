"""fla's models on the CPU under `fla_torch_paths()`: every family the linear-attention suite uses, pure and as a
hybrid with fla's softmax attention layers (`config.attn`), tiny and random.

- A forward runs, and its logits equal those of a forward whose mixers run fla's own token-by-token naive
  references (`fla/ops/*/naive.py`) in place of the chunked torch paths; everything else (projections,
  convolutions, norms, rotary, attention) is the same code in both. Tolerance 2e-5 absolute on logits of
  magnitude below 1: each mixer agrees with its reference to ~1e-6 relative (tests/test_fla_ops.py), which four
  layers carry on to the logits; the largest difference measured was 5e-6 (HGRN2, whose undivided gates
  multiply out the longest decay products).
- Prefill then decode, one position at a time through fla's cache (states in fla's V-first layout, short
  convolution states, the attention's key/value cache), equals one forward pass.
- fla's attention layer returns its weights as its second output, equal to a computation by hand from the
  layer's own weights.
- fla's own attention forward runs around the torch stand-ins of its flash-attn calls: a padded batch's weights
  come back at each row's tokens, also in a decode step under a sliding window.
- The context manager leaves nothing behind, also when its body raises.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed")
warnings.filterwarnings("ignore", message=".*past_key_values.*")

from fla import models as fla_models  # noqa: E402
from fla.layers.attn import Attention  # noqa: E402
from fla.modules import FusedCrossEntropyLoss  # noqa: E402

from gated_attention.fla_cpu import torch_paths  # noqa: E402
from gated_attention.fla_cpu.torch_paths import fla_torch_paths  # noqa: E402

# family: (config class, model class, fla layer class of its mixer, config fields)
FAMILIES = {
    "gla": ("GLAConfig", "GLAForCausalLM", "GatedLinearAttention", {"num_heads": 2}),
    "retnet": ("RetNetConfig", "RetNetForCausalLM", "MultiScaleRetention", {"num_heads": 2}),
    "hgrn": ("HGRNConfig", "HGRNForCausalLM", "HGRNAttention", {}),
    "hgrn2": ("HGRN2Config", "HGRN2ForCausalLM", "HGRN2Attention", {"num_heads": 2, "expand_ratio": 16}),
    "delta_net": ("DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNet", {"num_heads": 2}),
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", "GatedDeltaNet", {"num_heads": 2, "head_dim": 16}),
    "kda": ("KDAConfig", "KDAForCausalLM", "KimiDeltaAttention", {"num_heads": 2, "head_dim": 16}),
}
HYBRID = {"layers": [1, 3], "num_heads": 4}  # fla's list of full-attention layers, 0-based
CASES = [(family, attn) for family in FAMILIES for attn in (None, HYBRID)]
IDS = [f"{family}-{'hybrid' if attn else 'pure'}" for family, attn in CASES]


def build(family: str, attn=None):
    config_class, model_class, _, fields = FAMILIES[family]
    config = getattr(fla_models, config_class)(
        hidden_size=64, num_hidden_layers=4, vocab_size=97, intermediate_size=96, attn=attn, **fields
    )
    torch.manual_seed(0)
    with fla_torch_paths():  # fla's attention layer cannot even be built without flash-attn otherwise
        return getattr(fla_models, model_class)(config).eval()


def ids(B=2, T=70):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------ fla's naive references, in fla's call signatures


def naive(op: str, name: str):
    path = os.path.join(os.path.dirname(importlib.util.find_spec("fla").origin), "ops", op, "naive.py")
    spec = importlib.util.spec_from_file_location(f"fla_{op}_naive_for_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def l2(x):
    return x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)


def fla_state(state, state_v_first):
    return None if state is None else (state.transpose(-1, -2) if state_v_first else state)


def beta_of(beta, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, **_):
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta
    return beta * 2 if allow_neg_eigval else beta


def naive_gla(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False, state_v_first=False, **_):
    assert initial_state is None
    o, s = naive("gla", "naive_recurrent_gla")(q, k, v, g if g is not None else gk, output_final_state=output_final_state)
    return o, fla_state(s, state_v_first)


def naive_retention(q, k, v, initial_state=None, output_final_state=False, **_):
    assert initial_state is None
    H = q.shape[2]
    g = (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).log()  # RetNet's decays, from fla's retention ops
    return naive("simple_gla", "naive_recurrent_simple_gla")(q, k, v, g.expand(q.shape[:3]),
                                                             output_final_state=output_final_state)


def naive_hgrn(x, g, initial_state=None, output_final_state=False, **_):
    assert initial_state is None
    return naive("hgrn", "naive_recurrent_hgrn")(x, g, output_final_state=output_final_state)


def naive_delta_rule(q, k, v, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
    assert initial_state is None
    if use_qk_l2norm_in_kernel:
        q, k = l2(q), l2(k)
    o, s = naive("delta_rule", "delta_rule_recurrence")(*(x.transpose(1, 2) for x in (q, k, v, beta)),
                                                       output_final_state=output_final_state)
    return o.transpose(1, 2), s


def naive_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, state_v_first=False,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, **kw):
    assert initial_state is None
    if use_gate_in_kernel:  # fla's documented in-kernel gate: -exp(A_log) * softplus(g + dt_bias)
        g = -A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
    if use_qk_l2norm_in_kernel:
        q, k = l2(q), l2(k)
    o, s = naive("gated_delta_rule", "naive_recurrent_gated_delta_rule")(
        q, k, v, beta_of(beta, **kw), g, output_final_state=output_final_state
    )
    return o, fla_state(s, state_v_first)


def naive_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, state_v_first=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, **kw):
    assert initial_state is None and lower_bound is None
    if use_gate_in_kernel:  # fla's documented in-kernel gate, per key channel
        HV, K = g.shape[-2:]
        g = -A_log.float().exp().view(HV, 1) * F.softplus(g.float() + dt_bias.float().view(HV, K))
    if use_qk_l2norm_in_kernel:
        q, k = l2(q), l2(k)
    o, s = naive("kda", "naive_recurrent_kda")(q, k, v, g, beta_of(beta, **kw), output_final_state=output_final_state)
    return o, fla_state(s, state_v_first)


NAIVE_MIXERS = {
    "fla.ops.gla:chunk_gla": naive_gla,
    "fla.ops.gla:fused_recurrent_gla": naive_gla,
    "fla.ops.retention:chunk_retention": naive_retention,
    "fla.ops.retention:fused_recurrent_retention": naive_retention,
    "fla.ops.hgrn:chunk_hgrn": naive_hgrn,
    "fla.ops.hgrn:fused_recurrent_hgrn": naive_hgrn,
    "fla.ops.delta_rule:chunk_delta_rule": naive_delta_rule,
    "fla.ops.delta_rule:fused_recurrent_delta_rule": naive_delta_rule,
    "fla.ops.gated_delta_rule:chunk_gated_delta_rule": naive_gated_delta_rule,
    "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule": naive_gated_delta_rule,
    "fla.ops.kda:chunk_kda": naive_kda,
    "fla.ops.kda:fused_recurrent_kda": naive_kda,
}


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("family,attn", CASES, ids=IDS)
def test_forward_on_cpu_equals_fla_naive_references(family, attn, monkeypatch):
    model = build(family, attn)
    layer_class = getattr(fla.layers, FAMILIES[family][2])
    mixers = [type(layer.attn) for layer in model.model.layers]
    expected = [Attention if attn and i in attn["layers"] else layer_class for i in range(4)]
    assert mixers == expected, mixers
    x = ids()
    with fla_torch_paths(), torch.no_grad():
        logits = model(x).logits
    with monkeypatch.context() as patch:
        for key, reference in NAIVE_MIXERS.items():
            patch.setitem(torch_paths.TORCH_PATHS, key, reference)
        with fla_torch_paths(), torch.no_grad():
            reference_logits = model(x).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, reference_logits)  # the two paths really are different code
    torch.testing.assert_close(logits, reference_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family,attn", CASES, ids=IDS)
def test_prefill_then_decode_equals_one_pass(family, attn):
    """fla's cache on the torch paths: recurrent states (V-first where fla's layers keep them so), short
    convolution states and the attention's keys/values carry a prefill into single-position steps."""
    model = build(family, attn)
    x = ids(T=40)
    with fla_torch_paths(), torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :36], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(36, 40):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    # a step runs the recurrent form where the pass ran chunks: equal to rounding (logits ~1)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_left_padded_row_equals_the_row_alone(family):
    """fla unpads a padded batch into packed sequences (cu_seqlens): the torch paths run each alone, and the
    attention masks the padding. Equal to rounding (the unpadded row is batched differently)."""
    model = build(family, HYBRID)
    x = ids(T=20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    with fla_torch_paths(), torch.no_grad():
        padded = model(x, attention_mask=mask, use_cache=False).logits
        alone = model(x[:1, 5:], use_cache=False).logits
    torch.testing.assert_close(padded[:1, 5:], alone, atol=1e-6, rtol=0)


def rotate_by_hand(x, theta):
    """GPT-NeoX rotary over the whole head: position t turns the pair (i, i + D/2) by t / theta^(2i/D)."""
    T, D = x.shape[1], x.shape[-1]
    angle = torch.arange(T, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@pytest.mark.parametrize("family", ["gated_deltanet", "gla"])
def test_attention_layer_returns_its_weights(family):
    """A forward hook on fla's Attention reads [B, H, T, T] weights: softmax(q k^T / sqrt(D)) with q, k
    the layer's own projections after its rotary, computed here by hand in fp64 from the layer's weights.
    Tolerance 1e-6 absolute on weights in [0, 1]: the layer's fp32 rounding."""
    model = build(family, HYBRID)
    layer = model.model.layers[1].attn
    assert isinstance(layer, Attention)
    seen = {}

    def hook(module, args, kwargs, output):
        seen["input"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["weights"] = output[1]

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        with fla_torch_paths(), torch.no_grad():
            model(ids(T=12))
    finally:
        handle.remove()
    x = seen["input"].double()
    B, T, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    q = rotate_by_hand((x @ layer.q_proj.weight.double().T).view(B, T, H, D), layer.rope_theta)
    k = rotate_by_hand((x @ layer.k_proj.weight.double().T).view(B, T, layer.num_kv_heads, D), layer.rope_theta)
    k = k.repeat_interleave(H // layer.num_kv_heads, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    expected = scores.softmax(-1)
    assert seen["weights"].shape == (B, H, T, T) and seen["weights"].dtype == torch.float32
    torch.testing.assert_close(seen["weights"].double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding-window"])
def test_a_padded_batch_gives_each_rows_weights_at_its_tokens(window):
    """fla's own forward unpads a left-padded batch before its flash-attn calls and pads the output back: the
    weights it returns are laid out as the batch, row 0's equal to those of its tokens alone at their
    positions and zero at the padding, in the prefill and in a decode step after it (where fla cuts a sliding
    window's mask to the window). The cached logits equal the row alone too. fp32 rounding: 1e-6."""
    model = build("gla", {**HYBRID, "window_size": window})
    layer = model.model.layers[1].attn
    x = ids(T=12)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0
    seen = []
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out[1]))
    try:
        with fla_torch_paths(), torch.no_grad():
            out = model(x, attention_mask=mask[:, :12], use_cache=True)
            step = model(x[:, -1:], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            alone = model(x[:1, 4:], use_cache=True)
            alone_step = model(x[:1, -1:], past_key_values=alone.past_key_values, use_cache=True)
    finally:
        handle.remove()
    padded, padded_step, weights, weights_step = seen
    assert padded.shape == (2, 4, 12, 12) and weights.shape == (1, 4, 8, 8)
    torch.testing.assert_close(padded[0, :, 4:, 4:], weights[0], atol=1e-6, rtol=0)
    assert not padded[0, :, :4].any() and not padded[0, :, :, :4].any()
    S = padded_step.shape[-1]  # all 13 positions, or the window fla keeps in its cache
    assert padded_step.shape[:3] == (2, 4, 1) and S == (13 if window is None else window)
    kept = weights_step.shape[-1]
    torch.testing.assert_close(padded_step[0, :, :, S - kept :], weights_step[0], atol=1e-6, rtol=0)
    assert not padded_step[0, :, :, : S - kept].any()
    torch.testing.assert_close(step.logits[:1], alone_step.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["swish", "sigmoid", "logsigmoid"])
def test_an_activation_a_layer_stored_runs_on_the_cpu_with_its_gradient(name):
    """`ACT2FN[name]` is fla's Triton Function itself, held by a layer from its construction (GLA's output gate
    with `fuse_norm=False`): the kernels it calls run torch's, forward and backward. Tolerance 1e-6: fp32
    inside, as fla's kernels compute."""
    from fla.modules.activations import ACT2FN

    x = torch.randn(3, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with fla_torch_paths():
        y = ACT2FN[name](x)
        (dx,) = torch.autograd.grad(y.sum(), x)
    expected = {"swish": F.silu, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid}[name](x)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(dx, torch.autograd.grad(expected.sum(), x)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("fields", [{"fuse_norm": False}, {"feature_map": "swish"}],
                         ids=["unfused-output-gate", "feature-map"])
def test_gla_with_a_stored_activation_equals_it_with_torchs(fields):
    """GLA's forward paths beside its defaults (the other tests) that call an activation fla's `ACT2FN` gave
    the layer at construction (RetNet's comes from transformers' `ACT2FN`, plain torch): replaced by torch's
    own, the logits are the same (to fp32 rounding: 1e-6)."""
    config = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=2, vocab_size=97, intermediate_size=96,
                                  num_heads=2, **fields)
    torch.manual_seed(0)
    model = fla_models.GLAForCausalLM(config).eval()
    x = ids(T=20)
    with fla_torch_paths(), torch.no_grad():
        logits = model(x).logits
        for layer in model.model.layers:
            for attr in ("gate_fn", "feature_map_fn"):
                if getattr(layer.attn, attr, None) is not None:
                    setattr(layer.attn, attr, F.silu)
        reference = model(x).logits
    torch.testing.assert_close(logits, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fields", [{}, {"fuse_cross_entropy": False, "fuse_linear_cross_entropy": True}],
                         ids=["fused-cross-entropy", "fused-linear-cross-entropy"])
def test_a_forward_with_labels_gives_the_cross_entropy_of_its_logits(fields):
    """fla's fused losses (its default with labels) on the CPU: the loss equals torch's cross-entropy of the
    model's own logits, ignored labels left out (fp32 both: 1e-6)."""
    config = fla_models.GLAConfig(hidden_size=64, num_hidden_layers=2, vocab_size=97, num_heads=2, **fields)
    torch.manual_seed(0)
    model = fla_models.GLAForCausalLM(config).eval()
    x = ids(T=12)
    labels = x.clone()
    labels[0, :4] = -100
    with fla_torch_paths(), torch.no_grad():
        loss = model(x, labels=labels).loss
        logits = model(x).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 97).float(), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)


def test_the_cross_entropy_options_mean_what_fla_says():
    """Label smoothing, logit scale, softcap and z-loss (fla's `cross_entropy_loss`), against torch's
    cross-entropy on logits transformed by hand; fp64 inputs, fp32 inside: 1e-5."""
    from gated_attention.fla_cpu.modules.cross_entropy import torch_cross_entropy_loss

    logits = torch.randn(6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    target = torch.tensor([3, 0, -100, 10, 5, 5])
    loss, z_loss = torch_cross_entropy_loss(logits, target, label_smoothing=0.1, logit_scale=0.5,
                                            logit_softcapping=1.5, lse_square_scale=0.01)
    x = 1.5 * torch.tanh(logits * 0.5 / 1.5)
    lse = x.logsumexp(-1)
    expected_z = torch.where(target != -100, 0.01 * lse**2, 0.0)
    expected = F.cross_entropy(x, target, label_smoothing=0.1, reduction="none") + expected_z
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(z_loss.double(), expected_z, atol=1e-5, rtol=0)


def fla_namespaces() -> dict:
    return {name: dict(vars(module)) for name, module in sys.modules.items()
            if module is not None and (name == "fla" or name.startswith("fla."))}


def test_nothing_is_left_patched_also_after_an_error():
    before = fla_namespaces()
    forward = Attention.forward
    loss_forward = FusedCrossEntropyLoss.forward
    with pytest.raises(RuntimeError, match="inside"):
        with fla_torch_paths():
            assert sys.modules["fla.layers.gla"].chunk_gla is not before["fla.layers.gla"]["chunk_gla"]
            assert Attention.forward.fla_original is forward
            assert sys.modules["fla.layers.attn"].flash_attn_func is not before["fla.layers.attn"]["flash_attn_func"]
            assert FusedCrossEntropyLoss.forward is not loss_forward
            raise RuntimeError("inside")
    after = fla_namespaces()
    changed = [(name, attr) for name, namespace in before.items() for attr, value in namespace.items()
               if after.get(name, {}).get(attr, value) is not value]
    added = [(name, attr) for name, namespace in after.items() for attr in namespace.keys() - before.get(name, {}).keys()]
    assert not changed and not added, (changed, added)
    assert Attention.forward is forward and FusedCrossEntropyLoss.forward is loss_forward


def test_without_the_context_fla_cannot_build_its_attention_without_flash_attn():
    """The pitfall the context manager covers (skipped where flash-attn is installed)."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ImportError, match="Flash Attention"):
        Attention(hidden_size=32, num_heads=2)
    with fla_torch_paths():
        Attention(hidden_size=32, num_heads=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_fla_kernels_run_and_the_attention_still_returns_weights(family):
    """On a GPU the context keeps fla's kernels for the mixers and runs the torch attention, whose weights a
    hook reads there too; the logits equal the CPU torch paths' to 5e-3 (TF32 matmuls in fla's kernels)."""
    model = build(family, HYBRID)
    x = ids(T=70)
    with fla_torch_paths(), torch.no_grad():
        cpu = model(x).logits
        model.cuda()
        seen = []
        handle = model.model.layers[1].attn.register_forward_hook(lambda m, a, out: seen.append(out[1]))
        try:
            gpu = model(x.cuda()).logits
        finally:
            handle.remove()
    assert seen and seen[0].is_cuda and seen[0].shape == (2, 4, 70, 70)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=5e-3, rtol=5e-3)
