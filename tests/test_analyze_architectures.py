"""`analyze` reads the hybrids transformers ships: the right layers, the model's own maps, known answers.

Each architecture is a tiny random model built from transformers' config class. Two references:

- transformers' own `output_attentions=True` on the same input, with the same eager attention: the
  captured maps must be the very tensors it returns (and so F-Attn equal to <= 1e-6, here exactly);
- a planted answer. The weights are set so that one attention layer f puts >= 0.9 of every query's
  attention on token 0 and the first token's residual spikes at X[f-1], the input of that layer; the
  plant is checked against transformers' own outputs first, then `analyze` must find it.

How the sink is planted, for any attention that reads q and k from the normed residual. Token 0 is
always BOS (the tokenizer prepends it). Residual channel C carries BOS only: its embedding is M there,
every other token's is 0, and every linear map that writes the residual has row C zeroed, so C stays
exactly 0 for every later token at every depth. Channel Q is A for every token and is never written
either. The attention's keys read only C (each head's last dim), its queries only Q: every key but
BOS's is exactly 0, every query a positive multiple of one vector, so the score on BOS is large and
all others are 0. The last dim of a head is unrotated or rotates slowest under RoPE (cos(24 * 3e-4)
~ 1), so position does not matter. The spike: token 0 sees only itself, so its activations are the
same for every input; the last residual-writing linear map of layer f-1 gets a row S that reads its
own input for token 0 and writes twice token 0's peak so far there (other tokens get what that row gives them).
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from gated_attention.analysis.analyze import check_intervention, run_analysis
from gated_attention.analysis.capture import Capture, torch_linear_attention
from gated_attention.analysis.interventions import apply_edits
from gated_attention.analysis.layout import model_layout
from gated_attention.cli import main
from test_analysis_capture import tiny_tokenizer

VOCAB, HIDDEN = 300, 64
BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAMBA = dict(mamba_d_state=8, mamba_expand=2)
# name -> (config, expected 1-based softmax-attention layers, expected layer types, the layer to plant the sink in)
ARCHITECTURES = {
    "zamba": (
        dict(model_type="zamba", num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2, num_attention_heads=4,
             num_key_value_heads=4, intermediate_size=64, mamba_dt_rank=8, n_mamba_heads=2, **MAMBA),
        [3, 6], ["linear_attention", "linear_attention", "hybrid"] * 2, 6,
    ),
    "zamba2": (
        dict(model_type="zamba2", num_hidden_layers=6, layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba"],
             num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, mamba_headdim=16, n_mamba_heads=8,
             num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=True, **MAMBA),
        [2, 5], ["linear_attention", "hybrid", "linear_attention", "linear_attention", "hybrid", "linear_attention"], 5,
    ),
    "falcon_h1": (
        dict(model_type="falcon_h1", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
             mamba_chunk_size=16),
        [1, 2, 3], ["hybrid"] * 3, 3,
    ),
    "nemotron_h": (
        dict(model_type="nemotron_h", num_hidden_layers=6, hybrid_override_pattern="M-*M-*", num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
             ssm_state_size=8, n_groups=1, chunk_size=16),
        [3, 6], ["linear_attention", "mlp", "full_attention"] * 2, 3,
    ),
    "recurrent_gemma": (
        dict(model_type="recurrent_gemma", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             intermediate_size=64, lru_width=64, attention_window_size=32, block_types=["recurrent", "recurrent", "attention"]),
        [3, 6], ["linear_attention", "linear_attention", "sliding_attention"] * 2, 6,
    ),
    "kimi_linear": (
        dict(model_type="kimi_linear", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             intermediate_size=64, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             mlp_layer_types=["dense", "dense", "dense", "sparse"], num_local_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16,
             linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4, "head_dim": 16,
                                 "short_conv_kernel_size": 4}),
        [2, 4], ["linear_attention", "full_attention"] * 2, 4,
    ),
}
# Hybrids that were read right before the layout came from declarations: kept exact (name -> config, attention layers).
HYBRID_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
MOE = dict(num_experts_per_tok=1)
ALSO_EXACT = {
    "jamba": dict(model_type="jamba", num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2, use_mamba_kernels=False, **MOE),
    "bamba": dict(model_type="bamba", num_hidden_layers=4, attn_layer_indices=[1, 3], num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
                  mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2),
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_local_experts=2,
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                             mamba_expand=2, **MOE),
    "lfm2": dict(model_type="lfm2", num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, layer_types=HYBRID_TYPES,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, **MOE),
}
M, A = 1000.0, 4.0  # BOS's channel, every token's query channel
C, Q, S = 5, 9, 13  # residual channels: BOS only, queries, the spike


def build(name: str) -> nn.Module:
    kwargs = dict(ARCHITECTURES[name][0])
    model_type = kwargs.pop("model_type")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **BASE, **kwargs)).eval()


# ---------------------------------------------------------------- planting


def _residual_writers(layer: nn.Module, hidden: int) -> list[nn.Linear]:
    return [m for m in layer.modules() if isinstance(m, nn.Linear) and m.out_features == hidden]


def _last_writer_input(model, layer: nn.Module, ids) -> tuple[nn.Linear, torch.Tensor, float]:
    """The residual-writing linear map of `layer` that runs last, its input for token 0, and token 0's
    largest |activation| in the residual at the input of `layer`."""
    calls = []
    handles = [m.register_forward_hook(lambda m, args, out: calls.append((m, args[0][0, 0].detach().clone())))
               for m in _residual_writers(layer, model.config.hidden_size)]
    handles.append(layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append(
        (None, (args[0] if args else kwargs["hidden_states"])[0, 0].abs().max().item())), with_kwargs=True))
    try:
        with torch_linear_attention(model):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    linear, x0 = calls[-1]
    return linear, x0, next(value for m, value in calls if m is None)


def _head_rows(out_features: int, head_dim: int, dims: range | None = None) -> list[int]:
    """Each head's last dim (or the given dims within each head) in a head-major projection output."""
    dims = dims if dims is not None else range(head_dim - 1, head_dim)
    return [h * head_dim + d for h in range(out_features // head_dim) for d in dims]


def _columns(linear: nn.Linear, channel: int, hidden: int) -> list[int]:
    # Zamba's attention reads [residual, embeddings] concatenated: the channel appears once per copy.
    return list(range(channel, linear.in_features, hidden))


def _set_qk(attention: nn.Module, hidden: int) -> None:
    name = type(attention).__name__
    with torch.no_grad():
        if name == "KimiLinearAttention":  # MLA: keys' rotary part from kv_a_proj, shared by the heads
            rope, nope = attention.qk_rope_head_dim, attention.qk_nope_head_dim
            q, kv = attention.q_proj, attention.kv_a_proj_with_mqa
            q.weight.zero_()
            kv.weight.zero_()  # the latent is 0: so are every key's no-rope part and every value
            q_rows = _head_rows(q.out_features, nope + rope, range(nope + rope - 1, nope + rope))
            k_rows = [kv.out_features - 1]
        else:
            head_dim = attention.head_dim
            q, k = attention.q_proj, attention.k_proj
            q.weight.zero_()
            k.weight.zero_()
            q_rows, k_rows, kv = _head_rows(q.out_features, head_dim), _head_rows(k.out_features, head_dim), k
        for r in q_rows:
            q.weight[r, _columns(q, Q, hidden)] = 20.0
        for r in k_rows:
            kv.weight[r, _columns(kv, C, hidden)] = 20.0
        for linear in (q, kv):
            if linear.bias is not None:
                linear.bias.zero_()


@torch.no_grad()
def plant(model: nn.Module, f: int, bos: int) -> None:
    """Sink at attention layer f (1-based), spike in channel S at X[f-1] (see the module doc)."""
    hidden = model.config.hidden_size
    layout = model_layout(model)
    embed = model.get_input_embeddings().weight
    embed[:, C] = 0.0
    embed[:, Q] = A
    embed[bos, C] = M
    for layer in layout.layers:
        for linear in _residual_writers(layer, hidden):
            linear.weight[[C, Q]] = 0.0
            if linear.bias is not None:
                linear.bias[[C, Q]] = 0.0
    _set_qk(layout.attention_modules[f], hidden)
    ids = torch.tensor([[bos, 7, 8]])
    writer, x0, before = _last_writer_input(model, layout.layers[f - 2], ids)
    writer.weight[S] = 2 * before * x0 / x0.square().sum()  # row S reads token 0's input and writes twice its peak
    if writer.bias is not None:
        writer.bias[S] = 0.0


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.no_grad()
def test_capture_reads_transformers_own_maps_and_layer_types(name):
    model = build(name)
    _, attention_layers, types, _ = ARCHITECTURES[name]
    layout = model_layout(model)
    assert layout.attention_layers == attention_layers
    # As the model's config names them: releases before 5.24 name RecurrentGemma's by block (recurrent, attention).
    legacy = getattr(model.config, "layer_types", None) is None and getattr(model.config, "layers_block_type", None)
    assert layout.layer_types == (list(legacy) if legacy else types)
    ids = torch.randint(3, VOCAB, (1, 11))
    with Capture(model) as cap:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    record = cap.records[-1]
    assert sorted(record.attentions) == attention_layers
    assert len(out.attentions) == len(attention_layers)
    for f, reference in zip(attention_layers, out.attentions):
        assert torch.equal(record.attentions[f], reference), f"layer {f}"
    # The reduced capture gives the same F-Attn, first-token importance (the sink rate's score, over all queries) and
    # received attention as the maps, in float64.
    with Capture(model, reduce=True) as cap:
        model(input_ids=ids, use_cache=False)
    reduced = cap.records[-1]
    for f, reference in zip(attention_layers, out.attentions):
        a = reference[0].double()
        torch.testing.assert_close(reduced.first_token_attention[(f, 1)][0], a[:, 1:, 0].mean(-1), rtol=0, atol=1e-12)
        torch.testing.assert_close(reduced.first_token_importance[(f, 1)][0], a[:, :, 0].mean(-1), rtol=0, atol=1e-12)
        torch.testing.assert_close(reduced.received[(f, 1)][0], torch.tril(a, -1).sum(-2).mean(0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(ALSO_EXACT))
@torch.no_grad()
def test_the_other_hybrids_stay_exact(name):
    kwargs = dict(ALSO_EXACT[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **BASE, **kwargs)).eval()
    layout = model_layout(model)
    assert layout.attention_layers == [2, 4]
    ids = torch.randint(3, VOCAB, (1, 11))
    with Capture(model) as cap:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    assert sorted(cap.records[-1].attentions) == [2, 4] and len(out.attentions) == 2
    for f, reference in zip([2, 4], out.attentions):
        assert torch.equal(cap.records[-1].attentions[f], reference), f"layer {f}"
    if name == "qwen3_5_moe_text":  # its output gate: sigmoid of q_proj's second half per head
        assert sorted(cap.records[-1].gates) == [2, 4]


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_analyze_finds_a_planted_sink_and_spike(name, tokenizer, tmp_path):
    model = build(name)
    _, attention_layers, types, f = ARCHITECTURES[name]
    plant(model, f, tokenizer.bos_token_id)

    # The plant, checked with transformers' own outputs on one of the inputs analyze will read.
    ids = tokenizer("def f(x):\n    return x * 2\n", return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tokenizer.bos_token_id
    with torch.no_grad(), torch_linear_attention(model):
        model.set_attn_implementation("eager")
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    planted = out.attentions[attention_layers.index(f)][0]  # [H, T, T]
    assert planted[:, 1:, 0].min() >= 0.9
    m = torch.stack([h[0, 0].abs().max() for h in out.hidden_states[:-1]])  # X[0..L-1] of token 0
    assert m[f - 1] >= 1.9 * m[: f - 1].max()

    folder, report = tmp_path / name, tmp_path / "out"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "24",
                 "--bootstrap", "20"]) == 0  # fmt: skip

    layers = _csv(report / "layers.csv")
    assert [r["layer_type"] for r in layers[1:]] == model_layout(model).layer_types
    assert [int(r["layer"]) for r in layers if r["is_attention"] == "True"] == attention_layers
    assert float(layers[f]["f_attn"]) >= 0.9
    assert float(layers[f]["sink_rate"]) == 1.0  # every head of the planted layer puts >= 0.9 on token 0
    inputs = _csv(report / "inputs.csv")
    assert [int(r["consensus_sink"]) for r in inputs] == [0, 0, 0]
    arrays = np.load(report / "arrays.npz")
    for trajectory in arrays["m_first"]:  # the spike: the largest of f's block sits at its input, X[f-1]
        previous = max([a for a in attention_layers if a < f], default=0)
        block = list(range(max(previous, 1), f))
        assert max(block, key=lambda l: trajectory[l]) == f - 1
    j = attention_layers.index(f)
    assert arrays["first_token_attention"][:, j].mean() >= 0.9
    summary = (report / "summary.md").read_text()
    assert "consensus sink = first token in 3/3 inputs" in summary


def test_a_model_without_softmax_attention_says_so_and_reports_no_sink_metrics(tokenizer, tmp_path):
    import transformers

    # transformers' own class: a process that imported fla has fla's Mamba2 behind the Auto classes.
    config = transformers.Mamba2Config(**BASE, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=8, n_groups=1,
                                       chunk_size=16, expand=2)
    folder, report = tmp_path / "mamba2", tmp_path / "out"
    transformers.Mamba2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "16",
                 "--bootstrap", "20"]) == 0  # fmt: skip
    summary = (report / "summary.md").read_text()
    assert "the model has no softmax attention" in summary
    assert "consensus sink" not in summary.split("## Metrics")[1]
    metrics = {r["metric"] for r in _csv(report / "metrics.csv")}
    assert "m_act" in metrics and not metrics & {"f_attn", "sink_spike_alignment", "peak_excess", "inter_spike_retention"}
    arrays = np.load(report / "arrays.npz")
    assert arrays["m_first"].shape == (3, 3) and np.isfinite(arrays["m_act_layers"]).all()
    assert (report / "trajectory.png").is_file() and not (report / "first_token_attention.png").exists()


def test_minimax_lightning_attention_is_not_counted_as_softmax_attention():
    config = AutoConfig.for_model(
        "minimax", **BASE, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, num_local_experts=2, num_experts_per_tok=1, block_size=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    layout = model_layout(model)
    assert layout.attention_layers == [2, 4]
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad(), Capture(model) as cap:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    # transformers records both kinds under `attentions`, in call order: the softmax ones are the 2nd and 4th.
    assert len(out.attentions) == 4
    for f in (2, 4):
        assert torch.equal(cap.records[-1].attentions[f], out.attentions[f - 1])


def test_an_attention_layer_without_weights_is_one_line_and_writes_nothing(tokenizer, tmp_path, capsys, monkeypatch):
    model = build("nemotron_h")
    folder, report = tmp_path / "model", tmp_path / "out"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # An attention that returns no weights (as a flash-only implementation would): the map cannot be captured.
    cls = type(model_layout(model).attention_modules[3])
    forward = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: (forward(self, *a, **k)[0], None))
    capsys.readouterr()
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "16"]) == 2
    err = capsys.readouterr().err.strip()  # after the progress bars of loading and capture
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "gated-attention analyze: error: NemotronHForCausalLM layer 3: NemotronHAttention returned no attention "
        "weights, so its attention map cannot be captured"
    )
    assert not report.exists() and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_kimi_linear_runs_on_the_cpu_where_fla_imports():
    pytest.importorskip("fla")
    model = build("kimi_linear")
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad(), Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    assert sorted(cap.records[-1].attentions) == [2, 4]
    assert math.isfinite(float(cap.records[-1].residual[-1].abs().max()))


# ---------------------------------------------------------------- legacy classes, refusals, models without attention

# Model types whose classes predate `_can_record_outputs` (recorded_outputs.LEGACY_DECLARATIONS): the fields a tiny model
# needs beyond SIZES, given to transformers' config class (its `attribute_map` takes the common names).
SIZES = dict(BASE, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
LEGACY = {
    "bloom": {}, "falcon": {}, "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),  # layer 2: local
    "mpt": {}, "openai-gpt": {}, "cpmant": {}, "gpt_neox_japanese": {}, "megatron-bert": dict(is_decoder=True),
    "rembert": dict(is_decoder=True), "roformer": dict(is_decoder=True), "mvp": dict(decoder_layers=2), "trocr": {},
    "prophetnet": dict(num_hidden_layers=None, num_decoder_layers=2, ngram=2),  # its maps and X: the main stream's
    "xlnet": dict(d_head=16),  # time-major: model_records.VIEWS
}


def shipped(model_type: str) -> None:
    """Skip where the installed transformers has no such model (the floor release predates many)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers_version()} ships no {model_type!r}")


def counts_its_own_layers(model: nn.Module) -> None:
    """Longcat-Flash's declaration names its layer count (num_layers) in releases whose OutputRecorder has the field."""
    from gated_attention.analysis.layout import completed_declaration

    if not any(spec.num_layers_key for spec in completed_declaration(model)["hidden_states"]):
        pytest.skip(f"transformers {transformers_version()}'s declarations name no layer count: Longcat-Flash is refused "
                    "on its layer count instead")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def tiny(model_type: str, **fields) -> nn.Module:
    shipped(model_type)
    # None: the default (a config that takes the field under other names only)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in {**SIZES, **fields}.items() if v is not None})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def eager_output(model: nn.Module, **inputs):
    """transformers' own outputs with `output_attentions=True`, the model eager for the call: a legacy class that
    moved to transformers' attention interface (Falcon in 5.25) returns no maps under sdpa; one that did not
    ignores the switch (with a warning) and returns its maps when asked."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(**inputs, output_attentions=True)
    finally:
        model.set_attn_implementation(before)


def test_every_legacy_record_is_tested():
    from gated_attention.modeling.recorded_outputs import LEGACY_DECLARATIONS

    assert sorted(LEGACY) == sorted(LEGACY_DECLARATIONS)


@pytest.mark.parametrize("name", list(LEGACY))
@torch.no_grad()
def test_a_legacy_record_reads_transformers_own_maps(name):
    model = tiny(name, **LEGACY[name])
    from transformers import PreTrainedModel

    from gated_attention.compat import TRANSFORMERS_FLOOR

    declared = [type(m).__name__ for m in model.modules() if isinstance(m, PreTrainedModel) and getattr(m, "_can_record_outputs", None)]
    # Where the installed release declares the class, the declaration is read and the record is not (the record
    # serves the older releases): the maps below must still be transformers' own. Once the floor declares it too,
    # the record serves no release.
    assert not (declared and transformers_version().startswith(TRANSFORMERS_FLOOR + ".")), (
        f"transformers {TRANSFORMERS_FLOOR}, the floor, declares {declared}: delete the {name!r} record of "
        "recorded_outputs.LEGACY_DECLARATIONS and its row here")
    layout = model_layout(model)
    assert layout.attention_layers == [1, 2] and layout.weights_on_request == (not declared)
    ids = torch.randint(3, VOCAB, (1, 11))
    out = eager_output(model, input_ids=ids, output_hidden_states=True, use_cache=False)
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    assert len(out.attentions) == 2
    for f, reference in zip([1, 2], out.attentions):
        assert torch.equal(cap.records[-1].attentions[f], reference), f"layer {f}"
    # X[0], the input of layer 1, is transformers' first hidden state (CPM-Ant's with its prompt positions left out)
    assert len(cap.records[-1].residual) == 3 and torch.equal(cap.records[-1].residual[0], out.hidden_states[0])


# Models read in a layout of their own (model_records.VIEWS, model_records.PARALLEL_LAYERS): the fields of a tiny one.
OWN_LAYOUTS = {"xlnet": dict(d_head=16), "xlm": {}}


@pytest.mark.parametrize("name", list(OWN_LAYOUTS))
@torch.no_grad()
def test_a_model_in_a_layout_of_its_own_is_read_as_transformers_returns_it(name):
    """XLNet keeps [T, B, D] states and [T, T, B, H] weights; XLM's layers are entries of parallel lists, and it
    multiplies each layer's output by its padding mask in place afterwards. Every X[l] and map must be transformers'
    own, and an edit of X[l] must reach the model in its layout."""
    from gated_attention.analysis.interventions import apply_edits

    model = tiny(name, **OWN_LAYOUTS[name])
    layout = model_layout(model)
    assert layout.attention_layers == [1, 2]
    ids = torch.tensor([[1, 5, 9, 7, 9, 11, 13, 0, 0]])  # id 0: the pad index, whose count XLM masks at the end
    out = model(input_ids=ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    for reduce in (False, True):
        with Capture(model, reduce=reduce) as cap:
            model(input_ids=ids, use_cache=False)
        record = cap.records[-1]
        if reduce:  # M-Act's numbers: each token's largest |X[l]|
            assert [torch.equal(m, x.abs().amax(-1).float()) for m, x in zip(record.token_max, out.hidden_states)] == [True] * 3
            continue
        assert [torch.equal(x, reference) for x, reference in zip(record.residual, out.hidden_states)] == [True] * 3
        assert [torch.equal(record.attentions[f], a) for f, a in zip([1, 2], out.attentions)] == [True, True]
    with apply_edits(model, {1: (torch.tensor([3]), torch.tensor([7.0]))}, token=2):
        edited = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    assert edited[1][0, 2, 3] == 7.0 and torch.equal(edited[1][0, 1], out.hidden_states[1][0, 1])


def test_a_legacy_model_is_analysed_end_to_end_with_transformers_f_attn(tokenizer, tmp_path):
    from gated_attention.analysis.samples import builtin_samples

    model = tiny("falcon")
    folder, report = tmp_path / "falcon", tmp_path / "out"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "24",
                 "--bootstrap", "20"]) == 0  # fmt: skip
    # transformers' own maps on the same inputs: F-Attn per layer, the mean over inputs, heads and queries q >= 1.
    first = {1: [], 2: []}
    with torch.no_grad():
        for sample in builtin_samples(1):
            ids = tokenizer(sample.text, truncation=True, max_length=24, return_tensors="pt")["input_ids"]
            for f, a in zip([1, 2], eager_output(model, input_ids=ids, use_cache=False).attentions):
                first[f].append(a[0, :, 1:, 0].double().mean(-1))
    layers = _csv(report / "layers.csv")
    for f in (1, 2):
        assert abs(float(layers[f]["f_attn"]) - torch.stack(first[f]).mean().item()) <= 1e-6


# Model types whose weights are no per-layer [T, T] map of the input (recorded_outputs.REFUSED), and the fields of a tiny one.
REFUSED = {
    "reformer": dict(attn_layers=["local", "lsh"], axial_pos_shape=(4, 4), axial_pos_embds_dim=(32, 32),
                     attention_head_size=16, local_attn_chunk_length=4, lsh_attn_chunk_length=4, is_decoder=True),
    "blt": None,  # None: the catalog's tiny model (BLT sizes its byte encoder, global transformer and decoder apart)
    # MusicGen's causal LM is its decoder, built from the decoder's config (no Auto class maps it: `decoder()`)
    "musicgen_decoder": dict(ffn_dim=64),
    "musicgen_melody_decoder": dict(ffn_dim=64),
    "gemma4_assistant": None,  # the catalog's: every layer shares its target's keys and values
    "gemma4_unified_assistant": None,
}
DECODERS = {"musicgen_decoder": "MusicgenForCausalLM", "musicgen_melody_decoder": "MusicgenMelodyForCausalLM"}


def decoder(model_type: str, **fields) -> nn.Module:
    """A tiny causal LM of a decoder's model type, built with the class that takes its config (the class its saved
    checkpoints name in `architectures`)."""
    import transformers

    config = AutoConfig.for_model(model_type, **SIZES, **fields)
    torch.manual_seed(0)
    return getattr(transformers, DECODERS[model_type])._from_config(config).eval()


def test_every_refusal_is_tested():
    from gated_attention.modeling.recorded_outputs import REFUSED as TABLE

    # A whole MusicGen checkpoint is refused as its decoder's class is (test_loading.py): its composite type is not
    # built here.
    assert sorted(REFUSED) == sorted(set(TABLE) - {"musicgen", "musicgen_melody"})


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_that_is_no_map_of_the_input_is_refused_with_its_reason(name):
    from gated_attention.analysis.layout import LayoutError
    from gated_attention.modeling.recorded_outputs import REFUSED as TABLE

    shipped(name)
    if name in DECODERS:
        model = decoder(name, **REFUSED[name])
    else:
        model = tiny(name, **REFUSED[name]) if REFUSED[name] is not None else built_by_catalog(name)
    with pytest.raises(LayoutError) as e:
        model_layout(model)
    assert str(e.value) == f"{type(model).__name__} cannot be analysed: {TABLE[name]}"
    if name == "reformer":  # the reason, as transformers' own output shows it: chunks, not [B, H, T, T]
        with torch.no_grad():
            out = model(input_ids=torch.randint(3, VOCAB, (1, 16)), output_attentions=True, use_cache=False)
        assert out.attentions[0].shape == (1, 4, 4, 4, 8)
    if name == "blt":  # the reason, as the model runs: its global transformer's maps are of patches, not of the tokens
        ids, shapes = torch.randint(3, 256, (1, 24)), []
        handle = model.model.global_transformer.layers[0].self_attn.register_forward_hook(
            lambda m, args, out: shapes.append(out[1].shape[-1]))
        with torch.no_grad():
            model.set_attn_implementation("eager")
            model(input_ids=ids, use_cache=False)
        handle.remove()
        assert shapes and shapes[0] != 24
    if "assistant" in name:  # the reason, as the model runs: no input_ids, and no keys of its own in any layer
        text = model.config.get_text_config()
        assert text.num_kv_shared_layers == text.num_hidden_layers
        with pytest.raises(ValueError, match="inputs_embeds and shared_kv_states cannot be None"):
            model(input_ids=torch.randint(3, VOCAB, (1, 8)))
    if name in DECODERS:  # the reason, as the model runs: one row of codes per codebook, which a row of text is not
        codebooks = model.config.num_codebooks
        with torch.no_grad():
            logits = model(input_ids=torch.randint(3, VOCAB, (codebooks, 8)), use_cache=False).logits
            assert logits.shape == (codebooks, 8, VOCAB)  # [B * num_codebooks, T, V]: a row of logits per codebook
            with pytest.raises(RuntimeError):  # one row of tokens: [1, T] is no [B * num_codebooks, T]
                model(input_ids=torch.randint(3, VOCAB, (1, 8)), use_cache=False)


def test_a_setting_only_the_user_can_choose_is_named_in_the_refusal():
    """X-MOD's forward needs its input language (config.default_language, no default): analyze cannot know the inputs'
    language, so it names the field and its choices; once set, the model is read (the catalog's sample: exact)."""
    from gated_attention.analysis.layout import LayoutError

    model = tiny("xmod", is_decoder=True, languages=["en_XX", "de_DE"])
    with pytest.raises(LayoutError) as e:
        model_layout(model)
    assert str(e.value) == (
        "XmodForCausalLM cannot be analysed: its config sets no `default_language`, which chooses the language adapter "
        "every layer runs; set it in the checkpoint's config.json to the inputs' (one of ['en_XX', 'de_DE'])")
    with pytest.raises(ValueError, match="Input language unknown"):  # transformers' own forward, without it
        model(input_ids=torch.randint(3, VOCAB, (1, 5)))
    model.set_default_language("de_DE")
    assert model_layout(model).attention_layers == [1, 2]


def test_a_refusal_exits_2_in_one_line_and_writes_nothing(tokenizer, tmp_path, capsys):
    folder, report = tmp_path / "model", tmp_path / "out"
    tiny("reformer", **REFUSED["reformer"]).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    capsys.readouterr()
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("gated-attention analyze: error: ReformerModelWithLMHead cannot be analysed: ")
    assert not report.exists()


def test_a_musicgen_checkpoint_is_refused_in_one_line_before_it_loads(tokenizer, tmp_path, capsys):
    """MusicGen's causal LM, saved alone (model type "musicgen_decoder") or inside the whole text-to-audio model (model
    type "musicgen", which transformers maps to the same causal LM), is its decoder: one line with the reason."""
    from transformers import EncodecConfig, MusicgenConfig, MusicgenForConditionalGeneration, T5Config

    shipped("musicgen_decoder")
    model = decoder("musicgen_decoder", **REFUSED["musicgen_decoder"])
    whole = MusicgenForConditionalGeneration(MusicgenConfig(
        text_encoder=T5Config(d_model=32, d_ff=32, num_layers=1, num_heads=2, d_kv=16, vocab_size=VOCAB).to_dict(),
        audio_encoder=EncodecConfig(hidden_size=16, num_filters=4, upsampling_ratios=[2, 2], codebook_size=64,
                                    codebook_dim=16, num_lstm_layers=1).to_dict(),
        decoder=model.config.to_dict()))
    for saved in (model, whole):
        folder, report = tmp_path / saved.config.model_type, tmp_path / f"{saved.config.model_type}-out"
        saved.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        capsys.readouterr()
        assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "16"]) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and not report.exists()
        assert err.splitlines()[-1] == "gated-attention analyze: error: MusicgenForCausalLM cannot be analysed: " + (
            "its inputs are audio codec codes, one row of input_ids per codebook ([B * num_codebooks, T]), not text tokens")


def test_xlstm_has_no_softmax_attention(tokenizer, tmp_path):
    model = tiny("xlstm", num_blocks=2, num_heads=4)
    layout = model_layout(model)
    assert layout.num_layers == 2 and layout.attention_layers == []
    folder, report = tmp_path / "xlstm", tmp_path / "out"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "16",
                 "--bootstrap", "20"]) == 0  # fmt: skip
    assert "the model has no softmax attention" in (report / "summary.md").read_text()


# ---------------------------------------------------------------- attention output gates transformers ships


def catalog():
    """benchmarks/analyze_catalog.py, whose tiny model of any causal-LM type these tests build."""
    import importlib.util
    import sys
    from pathlib import Path

    if "analyze_catalog" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "benchmarks" / "analyze_catalog.py"
        spec = importlib.util.spec_from_file_location("analyze_catalog", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["analyze_catalog"]


# model type -> (the gate's name under the decoder layer, or the names releases give it, the first one the model has;
# its score when its projection outputs 0)
GATED = {
    "lfm3": ("self_attn.g_proj", 0.5),
    "bailing_hybrid": ("self_attn.g_proj", 0.5),
    "laguna": ("self_attn.g_proj", math.log(2.0)),  # softplus
    "inkling2_text": (("self_attn.o_proj.gate_proj", "self_attn.gate_proj"), 0.5),  # 5.24 moved it into o_proj
    "dots3_note_text": ("self_attn.g_proj", 0.5),
    "hy_v4": ("self_attn.gate_proj", 0.5),
    "afmoe": ("self_attn.gate_proj", 0.5),
    "hrm_text": ("self_attn.gate_proj", 0.5),
    "minicpm5_moe": ("self_attn.q_gate_proj", 0.5),  # each head's second half of a fused projection
}


@pytest.mark.parametrize("name", list(GATED))
@torch.no_grad()
def test_output_gates_transformers_ships_are_captured_by_their_own_names(name):
    shipped(name)
    model = catalog().build(name)
    layout = model_layout(model)
    gate, at_zero = GATED[name]
    if not isinstance(gate, str):
        layer = layout.layers[layout.attention_layers[0] - 1]
        gate = next(n for n in gate if n in dict(layer.named_modules()))
    assert sorted(layout.gates) == layout.attention_layers and layout.gates
    assert {site.name for site in layout.gates.values()} == {gate}
    ids = torch.randint(3, 200, (1, 12))
    f = layout.attention_layers[-1]
    site, attention = layout.gates[f], layout.attention_modules[f]
    seen = []
    handle = attention.register_forward_hook(lambda m, args, out: seen.append(out[0]))
    try:
        with torch_linear_attention(model):
            model(input_ids=ids, use_cache=False)
            site.module.weight.zero_()  # the gate's projection outputs 0: every score is its activation at 0
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    # the gate is the one the attention's output goes through (each forward's last pass: HRM-Text loops its layers)
    assert not torch.equal(seen[len(seen) // 2 - 1], seen[-1])
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    scores = cap.records[-1].gates[f]
    assert scores.shape[:3] == (1, 12, site.num_heads)
    torch.testing.assert_close(scores, torch.full_like(scores, at_zero), rtol=0, atol=1e-7)


@torch.no_grad()
def test_a_gate_fused_into_q_gate_proj_is_read_as_the_sigmoid_of_each_heads_second_half():
    shipped("minicpm5_moe")
    model = catalog().build("minicpm5_moe")
    layout = model_layout(model)
    f = layout.attention_layers[-1]
    attention = layout.attention_modules[f]
    inputs = []  # the attention's input, which its q_gate_proj maps
    handle = attention.register_forward_pre_hook(
        lambda m, args, kwargs: inputs.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]),
        with_kwargs=True)  # fmt: skip
    try:
        with Capture(model) as cap:
            model(input_ids=torch.randint(3, 200, (1, 12)), use_cache=False)
    finally:
        handle.remove()
    heads, width = layout.gates[f].num_heads, attention.head_dim
    by_hand = torch.sigmoid(attention.q_gate_proj(inputs[-1]).float().view(1, 12, heads, 2 * width)[..., width:])
    torch.testing.assert_close(cap.records[-1].gates[f], by_hand, rtol=0, atol=0)


# ---------------------------------------------------------------- hyper-connections, towers, loops, composite configs


@pytest.mark.parametrize("name", ["deepseek_v4", "hy_v4"])
@torch.no_grad()
def test_hyper_connection_streams_are_read_as_the_model_reduces_them(name):
    shipped(name)
    model = catalog().build(name)
    layout = model_layout(model)
    assert layout.view.head is model.model.hc_head  # chosen once, when the layout is read
    # An edit of one state cannot be written back into several streams: refused, with the reason, before any input.
    ids = torch.randint(3, 200, (1, 12))
    for layers in (None, [0, 2]):  # at the attention layers' inputs, or at any residual position
        with pytest.raises(ValueError, match="several residual streams"):
            check_intervention(model, layout, "deletion", [(None, ids)], layers)
    with pytest.raises(ValueError, match="several residual streams"), apply_edits(model, {}):
        pass
    with torch_linear_attention(model):
        model.set_attn_implementation("eager")
        out = model.model(input_ids=ids, output_attentions=True, use_cache=False)
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    record = cap.records[-1]
    assert [tuple(x.shape) for x in record.residual] == [(1, 12, HIDDEN)] * (layout.num_layers + 1)
    # X[L] is what the model's own head reduces its streams to: through the final norm, its last hidden state.
    torch.testing.assert_close(model.model.norm(record.residual[-1]), out.last_hidden_state, rtol=0, atol=0)
    for f, reference in zip(layout.attention_layers, out.attentions):
        assert torch.equal(record.attentions[f], reference), f"layer {f}"


@torch.no_grad()
def test_streams_reduced_without_a_module_are_refused_in_one_true_line():
    """Gemma 3n's AltUp streams: transformers' own hidden states are the 4 streams, and only its forward's arithmetic
    after the last layer makes one state of them: there is no per-layer residual to read, by transformers either."""
    from gated_attention.analysis.capture import CaptureError

    shipped("gemma3n_text")
    model = catalog().build("gemma3n_text")
    ids = torch.randint(3, 200, (1, 12))
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert {h.dim() for h in out.hidden_states} == {4}
    with Capture(model) as cap, pytest.raises(CaptureError) as e:
        model(input_ids=ids, use_cache=False)
    assert str(e.value) == (
        "Gemma3nForCausalLM layer 1: its residual state has shape [4, 1, 12, 64] (several streams), which the model "
        "reduces to one [B, T, D] state only after its last layer and with no module of its own (transformers' hidden "
        "states are the streams too), so no layer has one residual state to read")
    assert not cap.records[-1].token_max


@pytest.mark.parametrize("name", ["git", "got_ocr2", "gemma3"])
@torch.no_grad()
def test_the_text_model_beside_a_tower_as_deep_is_the_one_read(name):
    shipped(name)
    model = catalog().build(name)  # the catalog makes the vision tower as deep as the text model: 2 layers each
    layout = model_layout(model)
    text = model.get_decoder() if name != "git" else model.git.encoder
    assert all(any(layer is m for m in text.modules()) for layer in layout.layers)
    ids = torch.randint(3, 200, (1, 12))
    with Capture(model) as cap:  # GOT-OCR2's text model is switched to eager attention too
        model(input_ids=ids, use_cache=False)
    model.set_attn_implementation("eager")
    for sub in model.modules():  # the reference: every submodel eager, as the capture runs it
        if hasattr(sub, "set_attn_implementation") and sub.config._attn_implementation != "eager":
            sub.set_attn_implementation("eager")
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    maps = [a for a in out.attentions if a.shape[-1] == 12]
    assert len(maps) == len(layout.attention_layers)
    for f, reference in zip(layout.attention_layers, maps):
        assert torch.equal(cap.records[-1].attentions[f], reference), f"layer {f}"


def test_a_layer_that_runs_twice_in_one_forward_is_one_line_not_the_last_pass():
    from gated_attention.analysis.capture import CaptureError

    model = tiny("llama", num_key_value_heads=2)
    with Capture(model):
        model.config.num_hidden_layers = 4  # the model now runs its two layers twice (a loop from layer 1)
        model.model.layers = nn.ModuleList([*model.model.layers, *model.model.layers])
        with pytest.raises(CaptureError, match=r"^LlamaForCausalLM layer 1 ran again in one forward \(the model runs its layers in a loop\)"):
            model(input_ids=torch.randint(3, VOCAB, (1, 9)), use_cache=False)


# Models that run some layers several times in one forward: model type -> (module, pass) of each layer call, in order.
LOOPS = {
    "inkling2_loop_text": [("model.layers.0", 1), ("model.layers.1", 1), ("model.layers.2", 1), ("model.layers.1", 2),
                           ("model.layers.2", 2), ("model.layers.3", 1)],  # every pass restarts from layer 1's input
    "dory": [("model.layers.0", 1), ("model.layers.1", 1), ("model.layers.2", 1), ("model.layers.1", 2),
             ("model.layers.2", 2), ("model.layers.3", 1)],  # Dory's config counts modules: model_records.LOOPED
    "hrm_text": [(f"model.{stack}_module.layers.{i}", p) for h in range(2)  # (L stack x 2 cycles, H stack) x 2 cycles
                 for stack, p in (("L", 2 * h + 1), ("L", 2 * h + 2), ("H", h + 1)) for i in range(2)],
}


@pytest.mark.parametrize("name", list(LOOPS))
@torch.no_grad()
def test_a_looping_layer_is_read_once_per_pass_as_transformers_returns_it(name):
    """transformers records one attention map and one hidden state per layer call: the capture's layer l is call l."""
    shipped(name)
    model = catalog().build(name)
    layout = model_layout(model)
    assert list(zip(layout.names, layout.passes)) == LOOPS[name]
    ids = torch.randint(3, 200, (1, 12))
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    model.set_attn_implementation("eager")
    out = model(input_ids=ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    record = cap.records[-1]
    assert len(out.attentions) == layout.num_layers == len(layout.attention_layers)
    for f, reference in zip(layout.attention_layers, out.attentions):
        assert torch.equal(record.attentions[f], reference), f"layer {f}"
    # X[l], whose largest |value| is M-Act's layer l, is call l's output; transformers' last one is after the final norm.
    assert len(record.residual) == len(out.hidden_states) == layout.num_layers + 1
    for l, (x, reference) in enumerate(zip(record.residual[:-1], out.hidden_states[:-1])):
        assert torch.equal(x, reference), f"X[{l}]"


def test_analyze_writes_one_row_per_pass_named_as_the_model_names_it(tokenizer, tmp_path):
    from gated_attention.analysis.samples import builtin_samples

    shipped("dory")
    cat, model = catalog(), catalog().build("dory")
    tok, samples = cat.tokenizer(), builtin_samples(1)
    run_analysis(model, tok, samples, tmp_path, max_length=24, n_bootstrap=10)
    rows = _csv(tmp_path / "layers.csv")[1:]
    assert [(r["name"], int(r["pass"])) for r in rows] == LOOPS["dory"]
    reference = cat.reference_f_attn(model, tok, samples, list(range(1, 7)), 6)
    assert all(abs(float(r["f_attn"]) - value) <= 1e-6 for r, value in zip(rows, reference, strict=True))
    arrays = np.load(tmp_path / "arrays.npz")
    assert arrays["m_first"].shape[1] == 7 and list(arrays["layer_passes"]) == [p for _, p in LOOPS["dory"]]


@torch.no_grad()
def test_a_capture_reads_the_base_model_run_alone_too():
    model = tiny("llama", num_key_value_heads=2)
    ids = torch.randint(3, VOCAB, (1, 9))
    with Capture(model) as cap:
        model.model(input_ids=ids, use_cache=False)  # not through the causal LM the capture was opened on
        model(input_ids=ids, use_cache=False)
    assert len(cap.records) == 2 and [len(r.residual) for r in cap.records] == [3, 3]
    assert all(torch.equal(a, b) for a, b in zip(cap.records[0].residual, cap.records[1].residual))


@torch.no_grad()
def test_a_second_attention_block_in_one_layer_is_a_row_of_its_own(tmp_path):
    """Longcat-Flash runs `self_attn.0`, then `self_attn.1` in every layer: transformers returns a map for each."""
    from gated_attention.analysis.samples import builtin_samples

    shipped("longcat_flash")
    cat, model = catalog(), catalog().build("longcat_flash")
    counts_its_own_layers(model)
    layout = model_layout(model)
    assert layout.attention_rows == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [layout.block_name(f, b) for f, b in layout.attention_rows] == [
        "model.layers.0", "model.layers.0.self_attn.1", "model.layers.1", "model.layers.1.self_attn.1"]
    ids = torch.randint(3, 200, (1, 12))
    with Capture(model) as cap:
        model(input_ids=ids, use_cache=False)
    model.set_attn_implementation("eager")
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    assert len(out.attentions) == 4
    for (f, b), reference in zip(layout.attention_rows, out.attentions):
        assert torch.equal(cap.records[-1].attention_map(f, b), reference), f"layer {f} block {b}"
    tok, samples = cat.tokenizer(), builtin_samples(1)
    run_analysis(model, tok, samples, tmp_path, max_length=24, n_bootstrap=10)
    rows = [r for r in _csv(tmp_path / "layers.csv") if r["is_attention"] == "True"]
    assert [r["name"] for r in rows] == [layout.block_name(f, b) for f, b in layout.attention_rows]
    assert [r["m_act"] for r in rows] == [rows[0]["m_act"], "", rows[2]["m_act"], ""]  # no state between the blocks
    reference = cat.reference_f_attn(model, tok, samples, [f for f, _ in layout.attention_rows], layout.num_layers)
    assert all(abs(float(r["f_attn"]) - value) <= 1e-6 for r, value in zip(rows, reference, strict=True))


# ---------------------------------------------------------------- a sample of the whole catalog

# Every class of benchmarks/analyze_catalog.py and every row of issue 44's table: a legacy class, attention-free
# models, a tower as deep as the text model, hyper-connections, attention replaced at short inputs, composite
# configs, output gates, two attention blocks in one layer, layers that loop, unreadable maps (of patches too),
# time-major states, layers that are no modules, per-layer-type rotary parameters, inputs that are no text tokens
# (a causal LM built from its decoder's config).
SAMPLE = ["gpt2", "bloom", "mamba", "xlstm", "gemma3", "deepseek_v4", "big_bird", "got_ocr2", "gemma4", "lfm3",
          "laguna", "minimax", "longcat_flash", "inkling2_loop_text", "reformer", "gemma3n_text", "blt",
          "xlnet", "xlm", "xmod", "cohere_compass_text", "musicgen", "dots3_note"]  # XLNet's context is -1: no limit, not a cut to -1 tokens


def built_by_catalog(name: str) -> nn.Module:
    """The catalog's tiny `name`; skipped, with the reason, where a release other than the one the catalog's rules are
    written for rejects it (Gemma 4's assistants on 5.23, whose config cannot share every layer's keys: fixed in 5.24)."""
    cat = catalog()
    try:
        return cat.build(name)
    except Exception as e:  # noqa: BLE001 - transformers' own validation, whatever it raises
        if transformers_version().startswith(f"{cat.EXPECTED_FOR}."):
            raise
        pytest.skip(f"transformers {transformers_version()} rejects the catalog's tiny {name} (its rules are written "
                    f"for {cat.EXPECTED_FOR}): {str(e).splitlines()[-1].strip()}")


@pytest.mark.parametrize("name", SAMPLE)
@pytest.mark.filterwarnings("error:Mean of empty slice:RuntimeWarning")  # Inkling2's padded heads, in the plots
def test_a_sample_of_the_catalog_has_its_expected_outcome(name):
    shipped(name)
    cat = catalog()
    if name == "longcat_flash":
        counts_its_own_layers(cat.build(name))
    from gated_attention.analysis.samples import builtin_samples

    kind, detail = cat.outcome(name, cat.tokenizer(), builtin_samples(1))
    if kind == "build failed" != cat.expected(name) and not transformers_version().startswith(f"{cat.EXPECTED_FOR}."):
        pytest.skip(f"transformers {transformers_version()} rejects the catalog's tiny {name} (its rules are written "
                    f"for {cat.EXPECTED_FOR}): {detail}")  # the catalog's config, not the analysis: nothing analysed
    assert kind == cat.expected(name), detail
    if kind == "refused":
        assert cat.EXPECTED_REFUSED[name] in detail and "\n" not in detail


@torch.no_grad()
def test_a_gemma4_with_its_towers_keeps_each_submodels_attention_setting(tokenizer, tmp_path):
    """Released Gemma 4 checkpoints hold vision and audio towers, and the audio tower runs eager attention only
    (transformers refuses it "sdpa"). The analysis switches the whole model to eager while it captures, then gives
    each submodel its own setting back, not the text model's."""
    shipped("gemma4")
    from transformers import Gemma4Config, PreTrainedModel

    from gated_attention.analysis.samples import builtin_samples

    cat = catalog()
    kwargs = cat.shrink(cat.with_towers(Gemma4Config, Gemma4Config().to_dict()), 2)
    kwargs["text_config"].update(vocab_size=300)  # the catalog tokenizer's ids (shrink gives the per-layer inputs as many)
    for key in ("model_type", "transformers_version", "architectures"):
        kwargs.pop(key, None)
    model = AutoModelForCausalLM.from_config(Gemma4Config(**kwargs)).eval()
    assert model.config.text_config.vocab_size_per_layer_input == 300  # not 262,144 rows of every layer's input

    def settings() -> dict[str, str]:
        return {name: sub.config._attn_implementation for name, sub in model.named_modules() if isinstance(sub, PreTrainedModel)}

    before = settings()  # the audio tower's "eager" beside the rest's "sdpa" (5.17 lets the audio tower run sdpa too)
    assert before["model.language_model"] == "sdpa" and "model.audio_tower" in before
    run_analysis(model, tokenizer, builtin_samples(1), tmp_path / "out", max_length=16, n_bootstrap=10)
    assert settings() == before
    assert (tmp_path / "out" / "summary.md").is_file()


def test_the_catalog_keeps_each_kept_layers_own_overrides_under_its_new_index():
    """Dots3-Note's sliding layers (from layer 2 of 46) have head sizes of their own, in `per_layer_config` keyed by
    layer: the 2 layers the catalog keeps (one of each type) keep theirs, renumbered, or its validation fails."""
    types = ["indexed", "indexed", "sliding", "sliding", "indexed", "sliding"]
    d = dict(num_hidden_layers=6, layer_types=types, mlp_layer_types=["dense"] + ["sparse"] * 5,
             per_layer_config={"02": "swa", "03": "swa", "05": "swa"})
    out = catalog().shrink(d, 2)
    assert out["layer_types"] == ["indexed", "sliding"] and out["mlp_layer_types"] == ["dense", "sparse"]
    assert out["per_layer_config"] == {"01": "swa"}
    four = catalog().shrink({**d, "per_layer_config": {2: "swa", 3: "swa", 5: "swa"}}, 4)
    assert four["layer_types"] == types[:4] and four["per_layer_config"] == {2: "swa", 3: "swa"}


def test_the_catalog_flags_a_type_it_has_no_expectation_for(monkeypatch, capsys):
    cat = catalog()
    monkeypatch.setattr(cat, "EXPECTED_EXACT", cat.EXPECTED_EXACT - {"gpt2"})  # as a new transformers type would be
    assert cat.main(["gpt2", "bloom"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines()[:2]] == [["gpt2", "exact", "NEW"], ["bloom", "exact", "2"]]
    assert "flagged: 1 (gpt2)" in out


@pytest.mark.parametrize("name", ["Emu3", "Mllama"])
def test_a_text_model_saved_alone_loads_with_the_class_its_config_names(name, tmp_path, capsys):
    """Emu3ForCausalLM / MllamaForCausalLM save model type "emu3_text_model", which no Auto class maps."""
    import transformers

    shipped(f"{name.lower()}_text_model")
    cat = catalog()
    config_class = getattr(transformers, f"{name}TextConfig")
    fields = {k: v for k, v in cat.shrink(config_class().to_dict()).items() if k not in ("model_type", "transformers_version")}
    if name == "Mllama":
        fields["cross_attention_layers"] = [1]  # layer 2 attends to an image: it does not run without one
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config_class(**fields)).eval()
    folder, report, tok = tmp_path / "model", tmp_path / "out", cat.tokenizer()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    capsys.readouterr()
    code = main(["analyze", str(folder), "--out", str(report), "--n-per-domain", "1", "--max-length", "24", "--bootstrap", "10"])
    if name == "Mllama":
        assert code == 2 and not report.exists()
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "gated-attention analyze: error: MllamaForCausalLM layer 2: the decoder layer did not run in this forward, "
            "so it has no output")
        return
    assert code == 0
    from gated_attention.analysis.samples import builtin_samples

    rows = [r for r in _csv(report / "layers.csv") if r["is_attention"] == "True"]
    reference = cat.reference_f_attn(model, tok, builtin_samples(1), [int(r["layer"]) for r in rows], len(rows))
    assert [abs(float(r["f_attn"]) - value) <= 1e-6 for r, value in zip(rows, reference)] == [True] * len(rows) == [True, True]
