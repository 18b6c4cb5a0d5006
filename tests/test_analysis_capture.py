"""Capture hooks, interventions and `gated-attention analyze` on tiny random models of every family.

References: transformers' own `output_hidden_states` / `output_attentions` of
the same forward (compared exactly: the same ops on the same tensors), and for
the last residual state the model's final norm applied to it.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gated_attention as ga
from gated_attention.analysis.capture import Capture, torch_linear_attention
from gated_attention.analysis.layout import model_layout
from gated_attention.analysis.interventions import apply_edits, connection_edits, intervene, set_mean_edits, token_means
from gated_attention.cli import main

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
HYBRID_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# family -> (build kwargs, expected 1-based attention layers, expected gate kind or None)
FAMILIES = {
    "llama": (dict(model_type="llama"), [1, 2, 3, 4, 5], None),
    "mistral": (dict(model_type="mistral"), [1, 2, 3, 4, 5], None),
    "qwen2": (dict(model_type="qwen2"), [1, 2, 3, 4, 5], None),
    "qwen3": (dict(model_type="qwen3"), [1, 2, 3, 4, 5], None),
    "qwen3_moe": (dict(model_type="qwen3_moe", **MOE), [1, 2, 3, 4, 5], None),
    "qwen3_next": (
        dict(model_type="qwen3_next", **MOE, shared_expert_intermediate_size=16, **LINEAR, layer_types=HYBRID_TYPES),
        [2, 5],
        "q_proj",
    ),
    "qwen3_5_text": (dict(model_type="qwen3_5_text", **LINEAR, layer_types=HYBRID_TYPES), [2, 5], "q_proj"),
    "olmo_hybrid": (
        dict(model_type="olmo_hybrid", **LINEAR, layer_types=HYBRID_TYPES, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        [2, 5],
        None,
    ),
    "gated_attention-G1-elementwise": (dict(model_type="gated_attention"), [1, 2, 3, 4, 5], "attn_gate"),
    "gated_attention-G1-headwise-sliding": (
        dict(
            model_type="gated_attention",
            attn_gate={"granularity": "headwise"},
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
        ),
        [1, 2, 3, 4, 5],
        "attn_gate",
    ),
    "gated_attention-G5-dense": (dict(model_type="gated_attention", attn_gate={"position": "dense"}), [1, 2, 3, 4, 5], "attn_gate"),
    "gated_attention-ungated": (dict(model_type="gated_attention", attn_gate=None), [1, 2, 3, 4, 5], None),
    "gated_attention-low-rank-truncated": (
        dict(model_type="gated_attention", attn_gate={"rank": 4, "input_channels": 16}), [1, 2, 3, 4, 5], "attn_gate"
    ),
    "gated_attention-sinks": (dict(model_type="gated_attention", attn_gate=None, attention_sinks=True), [1, 2, 3, 4, 5],
                              "sinks"),
    "gpt_oss": (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2), [1, 2, 3, 4, 5], "sinks"),
    "gated_attention_moe": (
        dict(model_type="gated_attention_moe", **MOE, shared_expert_intermediate_size=16), [1, 2, 3, 4, 5], "attn_gate"
    ),
    "gated_deltanet_hybrid": (dict(model_type="gated_deltanet_hybrid", **LINEAR, layer_types=HYBRID_TYPES), [2, 5], "attn_gate"),
    "gated_deltanet_hybrid-moe-ratio": (
        dict(model_type="gated_deltanet_hybrid", **LINEAR, **MOE, hybrid_ratio="2:1"), [2, 4], "attn_gate"
    ),
}


def families(*names: str) -> list:
    # The hybrid family is written alongside this toolkit; its cases run once it is registered.
    hybrid_missing = pytest.mark.skipif(
        not hasattr(ga, "GatedDeltaNetHybridConfig"), reason="GatedDeltaNetHybrid is not registered in gated_attention"
    )
    return [pytest.param(n, marks=hybrid_missing if n.startswith("gated_deltanet_hybrid") else ()) for n in names]


def build(family: str) -> torch.nn.Module:
    kwargs = dict(FAMILIES[family][0])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **TINY, **kwargs)
    return AutoModelForCausalLM.from_config(config).eval()


def count_hooks(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules()
    )


@pytest.fixture
def ids():
    return torch.randint(3, TINY["vocab_size"], (1, 9))


@pytest.mark.parametrize("family", families(*FAMILIES))
@torch.no_grad()
def test_capture_every_family(family, ids):
    model = build(family)
    _, attention_layers, gate_kind = FAMILIES[family]
    L = TINY["num_hidden_layers"]
    # transformers installs its own output-recording hooks on the first output_* call and keeps them.
    with torch_linear_attention(model):  # fla kernels would fail on CPU
        model(input_ids=ids, output_hidden_states=True, use_cache=False)
    hooks_before = count_hooks(model)
    with Capture(model) as cap:
        out = model(input_ids=ids, output_hidden_states=True, output_attentions=True, use_cache=False)
    record = cap.records[-1]
    assert cap.layout.attention_layers == attention_layers

    # X[0..L-1] are transformers' hidden_states[0..L-1]; X[L] is before the final norm:
    # hidden_states[-1] is the final norm of it, and differs from it.
    assert len(record.residual) == L + 1
    for l in range(L):
        assert torch.equal(record.residual[l], out.hidden_states[l]), f"X[{l}]"
    assert torch.equal(model.model.norm(record.residual[L]), out.hidden_states[L])
    assert not torch.allclose(record.residual[L], out.hidden_states[L])

    # Attention maps are keyed by 1-based layer and equal what the model returns (eager).
    assert sorted(record.attentions) == attention_layers
    for i, f in enumerate(attention_layers):
        assert torch.equal(record.attentions[f], out.attentions[i])
        assert record.attentions[f].shape == (1, TINY["num_attention_heads"], 9, 9)

    if gate_kind is None:
        assert record.gates == {}
    else:
        assert sorted(record.gates) == attention_layers
        assert {site.kind for site in cap.layout.gates.values()} == {gate_kind}
        scores = record.gates[attention_layers[0]]
        assert scores.shape[:2] == (1, 9) and 0 <= scores.min() and scores.max() <= 1  # sigmoid scores
    assert count_hooks(model) == hooks_before


@torch.no_grad()
def test_q_proj_gate_scores_are_the_models_gate(ids):
    # Qwen3.5 multiplies the attention output by sigmoid(gate) right before o_proj. Reference: rerun
    # with the gate half of q_proj zeroed, where the model multiplies by sigmoid(0) = 0.5 instead;
    # o_proj's inputs must then differ exactly by the captured scores / 0.5 (up to fp32 rounding).
    model = build("qwen3_5_text")
    attention = model.model.layers[1].self_attn
    H, D = TINY["num_attention_heads"], TINY["head_dim"]
    o_inputs = []
    handle = attention.o_proj.register_forward_pre_hook(lambda m, args: o_inputs.append(args[0]))
    try:
        with Capture(model) as cap:
            model(input_ids=ids, use_cache=False)
            attention.q_proj.weight.view(H, 2 * D, -1)[:, D:] = 0  # gate logits -> 0
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    scores = cap.records[0].gates[2]  # [B, T, H, D]
    assert scores.shape == (1, 9, H, D)
    torch.testing.assert_close(o_inputs[0], o_inputs[1] * 2 * scores.reshape(1, 9, H * D), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cap.records[1].gates[2], torch.full_like(scores, 0.5), rtol=0, atol=0)


@torch.no_grad()
def test_learned_sinks_are_read_as_the_share_the_keys_keep(ids):
    # A sink takes its share of each row and leaves the keys the rest: the rows of the map sum to that, which is
    # the gate the sink amounts to, sigmoid(lse - s_h). Large sinks make it far from 1.
    model = build("gated_attention-sinks")
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=3.0)
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    record = cap.records[-1]
    for f, weights in record.attentions.items():
        kept = weights.sum(-1, dtype=torch.float32).transpose(1, 2)[..., None]  # [B, T, H, 1]
        torch.testing.assert_close(record.gates[f], kept, rtol=0, atol=0)
    assert min(scores.min() for scores in record.gates.values()) < 0.5


@torch.no_grad()
def test_hooks_and_switches_undone_after_exit_and_exception(ids):
    model = build("qwen3_5_text")
    source = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    kernel = source.torch_chunk_gated_delta_rule
    before_impl = model.config._attn_implementation
    assert before_impl != "eager" and count_hooks(model) == 0

    with Capture(model) as cap:
        assert count_hooks(model) > 0
        assert model.config._attn_implementation == "eager"
        # The torch path on CPU: fla imports here and its Triton kernels fail on CPU tensors, so the forward
        # running at all is the check. Before 5.25 the capture swaps in the unwrapped torch function; 5.25's
        # wrapper (a `kernels` function module) chooses the torch path for CPU tensors itself (compat.py).
        model(input_ids=ids, use_cache=False)
    assert count_hooks(model) == 0 and model.config._attn_implementation == before_impl
    assert source.torch_chunk_gated_delta_rule is kernel
    assert len(cap.records) == 1

    with pytest.raises(RuntimeError, match="boom"):
        with Capture(model):
            model(input_ids=ids, use_cache=False)
            raise RuntimeError("boom")
    assert count_hooks(model) == 0 and model.config._attn_implementation == before_impl
    assert source.torch_chunk_gated_delta_rule is kernel

    # An exception inside the model's forward (bad token id) also leaves nothing behind.
    with pytest.raises(IndexError):
        with Capture(model):
            model(input_ids=torch.tensor([[10_000, 1]]), use_cache=False)
    assert count_hooks(model) == 0
    with pytest.raises(IndexError):
        with apply_edits(model, {1: (torch.tensor([0]), torch.tensor([0.0]))}):
            model(input_ids=torch.tensor([[10_000, 1]]), use_cache=False)
    assert count_hooks(model) == 0


@pytest.mark.parametrize("family", families("gated_attention-G1-elementwise", "qwen3_5_text", "gated_deltanet_hybrid"))
@pytest.mark.parametrize("kind", ["deletion", "set-mean", "connection"])
def test_intervention_identity_check_is_exact(family, kind, ids):
    model = build(family)
    mean = token_means(model, [ids, ids.flip(1)]) if kind == "set-mean" else None
    result = intervene(model, ids, kind, k=2, mean=mean)
    assert result.identity_exact and result.identity_max_abs_diff == 0.0
    assert list(result.coordinates) == [0]  # the first token, by default
    assert sorted(result.coordinates[0]) == [f - 1 for f in FAMILIES[family][1]]
    assert all(len(c) == 2 for c in result.coordinates[0].values())
    if kind == "deletion":
        assert (result.logits_intervened - result.logits_normal).abs().max() > 1e-4
    assert count_hooks(model) == 0


@pytest.mark.parametrize("kind", ["deletion", "set-mean"])
def test_intervention_at_chosen_layers_and_tokens_passes_the_identity_check(kind, ids):
    # X[0] (the embedding output), X[3] (a linear-attention layer's output) and X[5] (the last, before the final norm),
    # on tokens 0 and 4 of the hybrid.
    model = build("qwen3_5_text")
    mean = token_means(model, [ids, ids.flip(1)], tokens=[0, 4]) if kind == "set-mean" else None
    result = intervene(model, ids, kind, k=2, mean=mean, positions=[5, 0, 3], tokens=[4, 0])
    assert result.identity_exact and result.identity_max_abs_diff == 0.0
    assert {t: sorted(c) for t, c in result.coordinates.items()} == {0: [0, 3, 5], 4: [0, 3, 5]}
    assert not torch.equal(result.logits_intervened, result.logits_normal)
    assert count_hooks(model) == 0


@torch.no_grad()
def test_edits_reach_the_residual_stream(ids):
    # The planned values are what the next layer sees: capture under the edits and read them back.
    model = build("qwen3_5_text")
    with Capture(model, attentions=False) as cap:
        model(input_ids=ids, use_cache=False)
    normal = cap.records[-1].residual
    z = torch.stack([x[0, 0] for x in normal])  # [L+1, D]
    # Push the first token's trajectory down between the spikes so that connection must act.
    z_low = z.clone()
    z_low[2:4] *= 0.01
    edits = connection_edits(z_low, [1, 4], k=1)  # the inputs of attention layers 2 and 5
    assert sorted(edits) == [1, 2, 3, 4]
    with apply_edits(model, edits), Capture(model, attentions=False) as cap:
        model(input_ids=ids, use_cache=False)
    residual = cap.records[-1].residual
    for layer, (coords, values) in edits.items():
        torch.testing.assert_close(residual[layer][0, 0, coords], values, rtol=0, atol=0)
    assert not torch.equal(residual[2][0, 0], normal[2][0, 0])  # the lowered interior was lifted
    assert torch.equal(residual[1][0, 1:], normal[1][0, 1:])  # other tokens at the first edit: untouched


@torch.no_grad()
def test_set_mean_sets_the_chosen_coordinates_to_their_mean_over_the_inputs(ids):
    model = build("qwen3_5_text")
    inputs = [ids, ids.flip(1), ids.roll(3, 1)]  # three first tokens
    with Capture(model, attentions=False) as cap:
        for x in inputs:
            model(input_ids=x, use_cache=False)
    states = torch.stack([torch.stack([x[0] for x in record.residual]) for record in cap.records])  # [3, L+1, T, D]
    mean = token_means(model, inputs, tokens=[0, 1, 4])
    for t in (0, 1, 4):
        torch.testing.assert_close(mean[t], states[:, :, t].double().mean(0), rtol=0, atol=1e-12)
    result = intervene(model, ids, "set-mean", k=2, mean=mean)
    assert result.identity_exact
    edits = set_mean_edits(states[0, :, 0], mean[0], [1, 4], k=2)
    with apply_edits(model, edits), Capture(model, attentions=False) as cap:
        model(input_ids=ids, use_cache=False)
    for layer, (coords, values) in edits.items():
        assert torch.equal(cap.records[-1].residual[layer][0, 0, coords], mean[0][layer, coords].float())
    with pytest.raises(ValueError, match="mean over the inputs"):
        intervene(model, ids, "set-mean", k=2)
    with pytest.raises(ValueError, match="mean over the inputs"):  # a mean of other tokens than the ones edited
        intervene(model, ids, "set-mean", k=2, mean=mean, tokens=[2])


@torch.no_grad()
def test_set_mean_at_chosen_layers_and_tokens_changes_exactly_those_coordinates(ids):
    # Set-mean at X[2] and X[5] (outputs of decoder layers 2 and 5) on tokens 1 and 4: read back under the edits, the
    # chosen coordinates of those states hold each token's mean over the inputs; the states before X[2], every other
    # coordinate of X[2], and token 0 everywhere (causal: it reads no later token) are the normal pass's.
    model = build("qwen3_5_text")
    inputs = [ids, ids.flip(1), ids.roll(3, 1)]
    mean = token_means(model, inputs, tokens=[1, 4])
    with Capture(model, attentions=False) as cap:
        model(input_ids=ids, use_cache=False)
    normal = torch.stack([x[0] for x in cap.records[-1].residual])  # [L+1, T, D]
    chosen = {t: set_mean_edits(normal[:, t], mean[t], [2, 5], k=2) for t in (1, 4)}

    hooks = count_hooks(model)
    result = intervene(model, ids, "set-mean", k=2, mean=mean, positions=[2, 5], tokens=[1, 4])
    assert result.identity_exact and count_hooks(model) == hooks
    assert result.coordinates == {t: {p: c.tolist() for p, (c, _) in plan.items()} for t, plan in chosen.items()}
    with apply_edits(model, chosen[1], token=1), apply_edits(model, chosen[4], token=4), \
            Capture(model, attentions=False) as cap:
        logits = model(input_ids=ids, use_cache=False).logits
    edited = torch.stack([x[0] for x in cap.records[-1].residual])  # [L+1, T, D]
    torch.testing.assert_close(logits, result.logits_intervened, rtol=0, atol=0)  # what intervene measured
    changed = torch.zeros_like(normal[2], dtype=torch.bool)  # [T, D]
    for t, plan in chosen.items():
        for p, (coords, values) in plan.items():
            assert torch.equal(edited[p, t, coords], mean[t][p, coords].float())
        changed[t, plan[2][0]] = True
    assert torch.equal(edited[:2], normal[:2])
    assert torch.equal(edited[2][~changed], normal[2][~changed])
    assert (edited[2][changed] != normal[2][changed]).all()
    assert torch.equal(edited[:, 0], normal[:, 0])


def test_a_model_without_attention_takes_set_mean_at_the_residual_positions_it_is_given(tmp_path):
    # Mamba has no attention layer whose input to act at: the default is refused, a residual position is not.
    from transformers import MambaConfig

    from gated_attention.analysis.analyze import run_analysis
    from gated_attention.analysis.samples import builtin_samples

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    samples, tokenizer = builtin_samples(1), tiny_tokenizer()
    with pytest.raises(ValueError, match=r"MambaForCausalLM has no softmax attention \(--intervene-layers chooses"):
        run_analysis(model, tokenizer, samples, tmp_path / "refused", max_length=12, intervention="set-mean")
    assert not (tmp_path / "refused").exists()
    run_analysis(model, tokenizer, samples, tmp_path / "out", max_length=12, intervention="set-mean",
                 intervene_layers=[1], intervene_tokens=[3], n_bootstrap=10)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "On token 3 at X[l] for l = 1 " in summary and "exact on 3/3 inputs" in summary
    import csv

    with open(tmp_path / "out" / "intervention.csv", newline="") as f:
        normal, intervened = (float(row["perplexity"]) for row in csv.DictReader(f))
    assert normal != intervened  # token 3 differs between the inputs: its mean is none of its states


def test_model_layout_of_an_fla_hybrid():
    fla_models = pytest.importorskip("fla.models")
    config = fla_models.GatedDeltaNetConfig(
        hidden_size=32, num_hidden_layers=4, num_heads=2, head_dim=16, vocab_size=96,
        attn={"layers": [1, 3], "num_heads": 2, "num_kv_heads": 2},
    )
    from gated_attention.fla_cpu import fla_torch_paths

    with fla_torch_paths():  # fla's attention layer needs flash-attn, which has no CPU build, outside it
        model = fla_models.GatedDeltaNetForCausalLM(config)
    # fla lists its attention layers 0-based in config.attn["layers"]; the layout finds them as modules.
    layout = model_layout(model)
    assert layout.attention_layers == [2, 4]
    assert [type(layout.layers[i]).__name__ for i in range(4)] == ["GatedDeltaNetBlock"] * 4


# ---------------------------------------------------------------- command line


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from gated_attention.analysis.samples import builtin_samples

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<bos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([s.text for s in builtin_samples(1)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>")


def test_analyze_cli_end_to_end(tmp_path, capsys):
    import numpy as np

    config = ga.GatedAttentionConfig(**{**TINY, "vocab_size": 300, "num_hidden_layers": 3})
    model_dir, out = tmp_path / "model", tmp_path / "out"
    ga.GatedAttentionForCausalLM(config).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)

    argv = ["analyze", str(model_dir), "--out", str(out), "--n-per-domain", "1", "--max-length", "24"]
    assert main(argv + ["--intervene", "set-mean", "--k", "2", "--bootstrap", "50", "--sink-epsilon", "0.2"]) == 0
    for name in ("arrays.npz", "inputs.csv", "layers.csv", "peak_excess.csv", "gates.csv", "metrics.csv",
                 "intervention.csv", "trajectory.png", "first_token_attention.png", "gate_hist.png", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    arrays = np.load(out / "arrays.npz")
    assert arrays["m_first"].shape == (3, 4)  # prose, code, math; L + 1 = 4 positions
    assert arrays["full_attention_layers"].tolist() == [1, 2, 3]
    summary = (out / "summary.md").read_text()
    assert "## Intervention: set-mean, k = 2" in summary and "exact on 3/3 inputs" in summary
    for metric in ("f_attn", "sink_rate", "m_act", "gate_mean", "gate_frac_below_0.5", "sink_spike_alignment",
                   "inter_spike_retention"):
        assert f"| {metric} |" in summary, metric
    assert "exceeds epsilon = 0.2" in summary
    # The sink rate per layer: over inputs, the fraction of its heads whose attention on token 0 (all queries)
    # exceeds --sink-epsilon, read back from the arrays the same run wrote.
    import csv

    assert float(arrays["sink_epsilon"]) == 0.2
    importance = arrays["first_token_importance"]  # [N, n_attn, H]
    with open(out / "layers.csv", newline="") as f:
        layers = [row for row in csv.DictReader(f) if row["is_attention"] == "True"]
    assert [float(row["sink_rate"]) for row in layers] == pytest.approx((importance > 0.2).mean(axis=(0, 2)).tolist())
    assert "wrote" in capsys.readouterr().out

    text = tmp_path / "in.txt"
    text.write_text("first paragraph of text.\n\nsecond one, with a few more words in it.\n")
    assert main(["analyze", str(model_dir), "--out", str(tmp_path / "out2"), "--text-file", str(text), "--bootstrap", "10"]) == 0
    assert np.load(tmp_path / "out2" / "arrays.npz")["domain"].tolist() == ["text-file", "text-file"]


@pytest.mark.parametrize("epsilon", ["0", "1", "1.5", "-0.1", "nan", "x"])
def test_a_sink_epsilon_outside_zero_to_one_is_one_line(tmp_path, capsys, epsilon):
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path), "--out", str(tmp_path / "out"), "--sink-epsilon", epsilon])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--sink-epsilon" in err[-1] and "between 0 and 1" in err[-1]
    assert not (tmp_path / "out").exists()


def test_analyze_cli_bad_model_path_is_one_line(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model folder not found" in err
    (tmp_path / "empty").mkdir()
    assert main(["analyze", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot load model" in err
    assert not (tmp_path / "out").exists()


def test_the_weights_are_read_where_the_declaration_records_them():
    """An `OutputRecorder`'s `index` (PEGASUS-X records its attention weights third) is kept from the declaration
    to where the weights are read, not replaced by the usual second item."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
    from transformers.utils.output_capturing import OutputRecorder

    model = LlamaForCausalLM(LlamaConfig(**TINY))
    assert model_layout(model).weights_index == 1  # a plain class: transformers' default for attentions
    model.model._can_record_outputs = {"hidden_states": LlamaDecoderLayer,
                                       "attentions": OutputRecorder(LlamaAttention, index=2)}
    layout = model_layout(model)
    out, other, weights = torch.zeros(1, 2, 4), torch.zeros(1), torch.ones(1, 2, 3, 3)
    assert layout.weights_index == 2 and layout.view.weights((out, other, weights), layout.weights_index) is weights
