"""Every causal LM the installed transformers ships, analysed: exact, no softmax attention, or refused with its reason.

For each model type in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` this builds a tiny random model
from the type's default config (hidden 64, 2 layers, 4 where the config names each layer's type so that
every kind of layer stays, 4 heads, windows of 16, 8 experts; sub-configs such as a vision tower shrunk
the same way, so a tower is as deep as the text model; a tower the default config leaves out, as Gemma 4's
vision and audio towers, is built from its own defaults, as the released checkpoints have it), then:

- runs `analyze` on it (`run_analysis`, what the command line runs) on the built-in samples, one per
  domain, cut to 24 tokens: a ValueError is what `analyze` says in one line (exit 2, nothing
  written), any other exception a traceback;
- runs transformers' own `output_attentions=True` on the same inputs with every submodel eager:
  each attention layer's F-Attn in `layers.csv` (the mean attention on token 0 over inputs, heads and
  queries q >= 1) must agree within 1e-6, and there must be one map per attention layer.

Each outcome is printed against its expected class (`EXPECTED_*`: exact, none = no softmax attention,
refused with the words its line must hold; and the types this script cannot build). A model type
with no expectation (a new transformers release) is flagged NEW; an outcome that differs from its
expectation is flagged UNEXPECTED, and the script exits 1 if there is any. `--markdown PATH` writes
the table (docs/analyze_catalog.md).

    python benchmarks/analyze_catalog.py                     # every type, ~3 minutes on 2 cores
    python benchmarks/analyze_catalog.py bloom gemma3        # some types
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import warnings

# The expected outcome of every causal-LM type of transformers 5.25 (5.24 and the last line's types, new in 5.25), from this script's runs (benchmarks/RESULTS.md):
# a type not listed is NEW. "refused": the words its one line must hold. The tiny-config rules below are written
# for that release too: another's config classes may reject them (Cohere Compass's rotary fields on 5.17).
EXPECTED_FOR = "5.25"
EXACT, NONE = "exact", "none"
EXPECTED_EXACT = set("""
    afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 bailing_hybrid bamba bart beam bert bert-generation
    big_bird bigbird_pegasus biogpt bitnet blenderbot blenderbot-small bloom camembert codegen cohere cohere2
    cohere2_moe cohere_compass_text cpmant ctrl cwm data2vec-text dbrx deepseek_v2 deepseek_v3 deepseek_v32
    deepseek_v4 diffllama doge dory dots1 dots3_note dots3_note_text electra emu3 ernie ernie4_5 ernie4_5_moe exaone
    exaone4 exaone_moe falcon falcon_h1 flex_olmo flint fuyu gemma gemma2 gemma3 gemma3_text gemma4 gemma4_text
    gemma4_unified gemma4_unified_text git glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa got_ocr2 gpt-sw3 gpt2
    gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese gpt_oss gptj granite granite_swa granitemoe granitemoe_swa
    granitemoehybrid granitemoeshared helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax
    inkling2_loop_text inkling2_text inkling_text internlm3 iquestcoder jais2 jamba jetmoe kimi_linear kolibri1
    laguna lara_mini lfm2 lfm2_moe lfm3 llama llama4 llama4_text longcat_flash marian mbart megatron-bert mellum
    mimo_v2_flash minicpm3 minimax minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral mllama
    modernbert-decoder moshi moss_transcribe_diarize mpt mvp nanochat nemotron nemotron_h olmo olmo2 olmo3
    olmo_hybrid olmoe openai-gpt opt pegasus persimmon phi phi3 phi4_multimodal phimoe plbart prophetnet qwen2
    qwen2_moe qwen3 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen3_moe qwen3_next qwen4_exp qwen4_exp_text
    recurrent_gemma rembert roberta roberta-prelayernorm roc_bert roformer sarvam_mla sarvam_moe seed_oss smollm3
    solar_open stablelm starcoder2 trocr vaultgemma whisper xglm xlm xlm-roberta xlm-roberta-xl xlnet xmod youtu
    zamba zamba2 zaya
    ergo minicpm5_moe param2moe kolibri1_1
""".split())
EXPECTED_NONE = {"falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm"}
EXPECTED_REFUSED = {
    "reformer": "per chunk and hash bucket",  # transformers returns no [T, T] map either
    "blt": "patches its entropy model cuts",  # its global transformer's maps are of patches, not tokens
    "gemma3n_text": "several streams",  # AltUp: [4, B, T, D], reduced without a module of its own
    "musicgen": "audio codec codes",  # its causal LM is the decoder of a text-to-audio model: no text tokens in
    "musicgen_melody": "audio codec codes",
    "gemma4_assistant": "speculative-decoding assistant",  # reads its target model's states and keys, not tokens
    "gemma4_unified_assistant": "speculative-decoding assistant",
}
# The catalog cannot build a tiny model of these from the default config with its rules (its limit, not analyze's):
# Gemma 3n's audio and vision towers need timm (whose install would replace torch).
EXPECTED_NOT_BUILT = {"gemma3n"}
EXPECTED_ERROR: set[str] = set()

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, WINDOW = 64, 4, 2, 16, 64, 16
TOKENIZER_IDS = 300  # the catalog tokenizer's vocabulary (`tokenizer`)
SIZE_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim", "model_dim", "hidden_dim", "d_embed",
               "word_embed_proj_dim", "embedding_size", "dim_model", "embedding_dim", "hidden_size_global", "emb_dim"),
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
               "num_decoder_layers", "num_encoder_layers", "num_blocks"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
              "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads"),
    "ffn": ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
            "moe_intermediate_size", "shared_expert_intermediate_size", "d_inner", "dim_ff", "expert_intermediate_size",
            "feed_forward_size"),
    "window": ("sliding_window", "attention_window_size", "window_size", "local_window_size"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
}


def shrink(d: dict, layers: int = 2) -> dict:
    """A config dict with every size named in SIZE_KEYS made tiny, sub-configs (dicts with a model_type) too."""
    out = dict(d)
    old_layers = next((d[k] for k in SIZE_KEYS["layers"] if isinstance(d.get(k), int)), None)
    n = layers
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value, layers)
    rules = {"hidden": HIDDEN, "layers": n, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "window": WINDOW,
             "experts": 8}
    old_hidden = next((d[k] for k in SIZE_KEYS["hidden"] if isinstance(d.get(k), int)), None)
    old_heads = next((d[k] for k in SIZE_KEYS["heads"] if isinstance(d.get(k), int)), None)
    for group, value in rules.items():
        for key in SIZE_KEYS[group]:
            current = d.get(key)
            if isinstance(current, bool) or current is None:
                continue
            if group == "kv_heads" and isinstance(current, int):
                value = HEADS if current == old_heads else min(current, KV_HEADS)  # MLA keeps one kv head per head
            if group == "layers" and isinstance(current, int):
                value = min(current, n)
            if isinstance(current, int):
                out[key] = value
            elif isinstance(current, list) and current and all(isinstance(x, int) for x in current) and old_layers and len(current) == old_layers:
                out[key] = [value] * n  # a per-layer list (Gemma 3n's intermediate sizes)
    # A head size that is the hidden size over the heads stays so; a rotary part stays within the head.
    if old_hidden and old_heads and d.get("head_dim") == old_hidden // old_heads:
        out["head_dim"] = HIDDEN // HEADS
    if isinstance(d.get("rotary_dim"), int):
        out["rotary_dim"] = min(d["rotary_dim"], HIDDEN // HEADS // 2)
    if isinstance(out.get("num_experts_per_tok"), int):
        out["num_experts_per_tok"] = min(out["num_experts_per_tok"], 2)
    if isinstance(out.get("n_shared_experts"), int):
        out["n_shared_experts"] = min(out["n_shared_experts"], 1)
    for key in ("n_group", "num_group", "num_expert_group"):  # 8 experts in at most 2 groups, one group chosen
        if isinstance(out.get(key), int):
            out[key] = min(out[key], 2)
    if isinstance(out.get("topk_group"), int):
        out["topk_group"] = 1
    # Per-layer input embeddings (Gemma 3n, Gemma 4: a row of every layer's input per token id, 262,144 ids by default,
    # 134M parameters at 2 layers) need only the ids the catalog tokenizer gives: its vocabulary.
    if isinstance(out.get("vocab_size_per_layer_input"), int) and out["vocab_size_per_layer_input"] > TOKENIZER_IDS:
        out["vocab_size_per_layer_input"] = TOKENIZER_IDS
    # Per-layer values as long as the old depth: the layer types spread so that each kind stays, the others
    # their first n entries; per-layer overrides keyed by layer index, those of the layers the (attention) layer
    # types keep, under their new index (Dots3-Note's sliding layers have head sizes of their own).
    if old_layers:
        types = next((d[k] for k in TYPE_LISTS if isinstance(d.get(k), list) and len(d[k]) == old_layers), None)
        kept = spread(types, n) if types else list(range(n))
        for key, value in d.items():
            if isinstance(value, list) and len(value) == old_layers and key in TYPE_LISTS:
                out[key] = [value[i] for i in spread(value, n)]
            elif isinstance(value, list) and len(value) == old_layers and out[key] is value:
                out[key] = value[:n]
        for key, value in d.items():
            if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                by_index = {int(k): k for k in value}
                name = {old: str(new).zfill(len(k)) if isinstance(k := by_index[old], str) else new  # "02" stays 2 wide
                        for new, old in enumerate(kept) if old in by_index}
                out[key] = {name[old]: value[by_index[old]] for old in name}
    return out


TYPE_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types")


def spread(types: list, n: int) -> list[int]:
    """The indices of n layers that keep each kind of layer `types` has, in its order (a hybrid keeps its attention
    layers): the first layer of each kind, padded with the model's own first layers."""
    picked = sorted({types.index(k) for k in dict.fromkeys(types)})[:n]
    rest = [i for i in range(len(types)) if i not in picked]
    return sorted(picked + rest[: n - len(picked)])


# Qwen4-exp's sparse-attention indexer, which has no default sizes (its released config sets them): one kv head, a head
# that holds the attention's rotary part.
QSA = dict(head_dim=16, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)
ASSISTANT = dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                 enable_moe_block=False, use_double_wide_mlp=False)
# Fields the rules above get wrong for a type, given after them.
FIELDS = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "mamba2": dict(num_heads=2, n_groups=1),
    "xlstm": dict(embedding_dim=64, num_blocks=2),
    "deepseek_v2": dict(num_experts_per_tok=2),  # None by default
    "gemma3n_text": dict(num_kv_shared_layers=0, activation_sparsity_pattern=None),
    # tests/test_analyze_architectures.py's hybrids
    "bamba": dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
                  mamba_chunk_size=16, mamba_expand=2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
                             mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=(4, 4), axial_pos_embds_dim=(32, 32)),
    "xlnet": dict(d_head=16),
    # Per-layer-type rotary parameters, which its default leaves empty (the released config sets them)
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen4_exp_text": QSA,
    "qwen4_exp": dict(text_config=QSA),
    # X-MOD picks its language adapters by config.default_language, which has no default: analyze refuses a checkpoint
    # without one (the input's language is the user's to say); a released one sets it or is set by its user.
    "xmod": dict(default_language="en_XX"),
    # Loops (one row per pass): each with layers before, in and after the loop, and two passes. Dory's defaults
    # double its counts (released configs list attention and MLP blocks apart), Inkling2-loop's loop layers lie past
    # a 4-layer model, and HRM's per-stack count would stay at its default.
    "dory": dict(layer_types=None, num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                 n_recurrent_loops=2),
    "inkling2_loop_text": dict(n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3,
                               loop_num_passes=2),
    "hrm_text": dict(num_layers_per_stack=None, H_cycles=2, L_cycles=2),
    # Defaults of None the models need set (their released configs set them)
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "ministral": dict(head_dim=16),
    "nemotron": dict(num_key_value_heads=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_hidden_layers=4),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # Its towers' adapters map their width to the text model's, and validation checks both ends (its causal LM is the
    # text model: the towers are not built)
    "dots3_note": dict(vision_config=dict(adapter_in_dim=HIDDEN, adapter_out_dim=HIDDEN),
                       audio_config=dict(adapter_input_size=HIDDEN, adapter_out_dim=HIDDEN)),
    # The Gemma 4 assistants (speculative-decoding drafters) share every layer's keys and values with their target
    # model (0: the config then shares all of them) and have no per-layer inputs, MoE block or double-wide MLP
    "gemma4_assistant": dict(text_config=ASSISTANT),
    "gemma4_unified_assistant": dict(text_config=ASSISTANT),
    # Kolibri 1.1's indexed (top-k) attention layers read the keys of an earlier indexer layer of their type, and its
    # validator checks the layout its defaults give 50 layers: one sliding and one indexed layer, each twice, the
    # indexer at 1, its indexer sizes below the 24 tokens (so the top-k does choose), head_dim a multiple of 16
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"] * 2, num_hidden_layers=4,
                       index_layers=[1], kv_source_layers=[0, 1, 2, 1], mlp_only_layers=[0], mlp_only_intermediate_size=64,
                       index_topk=8, index_pool_size=64, index_compression=4, index_num_heads=1,
                       index_num_local_tokens=4, index_num_sink_tokens=1, head_dim=16, num_experts=8,
                       num_experts_per_tok=2),
    # BLT reads bytes (260 ids, fewer than the catalog tokenizer's 300) and hashes byte n-grams into 500,002 rows
    "blt": dict(vocab_size=300, encoder_hash_byte_group_vocab=1000, encoder_config=dict(vocab_size=300),
                decoder_config=dict(vocab_size=300), patcher_config=dict(vocab_size=300)),
}


# Types whose default config fails its own validation (Gemma 4's assistant: its text config's defaults are the target
# model's): their defaults are read with their FIELDS given.
INVALID_DEFAULTS = {"gemma4_assistant"}


# Types whose whole tiny config is given (the shrinking rules miss their Mamba sizes): tests/test_analyze_architectures.py's.
WHOLE = {
    "zamba": dict(hidden_size=64, num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=64, mamba_dt_rank=8, n_mamba_heads=2, mamba_d_state=8,
                  mamba_expand=2),
    "zamba2": dict(hidden_size=64, num_hidden_layers=6, layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba"],
                   num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, mamba_headdim=16, n_mamba_heads=8,
                   num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=True, mamba_d_state=8, mamba_expand=2),
}


# Types whose causal LM takes its decoder's config, not the type's (MusicGen's `MusicgenForCausalLM` is the decoder of
# a text-to-audio model, built from `MusicgenDecoderConfig`, which the Auto classes do not map to it): the config class,
# and the mapped class is built from it.
DECODER_CONFIGS = {"musicgen": "MusicgenDecoderConfig", "musicgen_melody": "MusicgenMelodyDecoderConfig"}


def with_towers(config_class, defaults: dict) -> dict:
    """`defaults` with every sub-config it leaves out (None) filled with that sub-config's own defaults: Gemma 4's
    vision and audio towers are optional in its config and present in every released checkpoint."""
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if key in defaults and defaults[key] is None and isinstance(sub_class, type):
            defaults[key] = sub_class().to_dict()
    return defaults


def build(model_type: str):
    """A tiny random model of `model_type`, with transformers' own classes (importing fla registers other
    models under some of transformers' model types: `bitnet`, `mamba2`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_class = getattr(transformers, DECODER_CONFIGS.get(model_type) or CONFIG_MAPPING_NAMES[model_type])
    if model_type in WHOLE:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config_class(**WHOLE[model_type])).eval()
    defaults = with_towers(config_class, config_class(**(FIELDS[model_type] if model_type in INVALID_DEFAULTS else {})).to_dict())
    layers = 4 if any(isinstance(defaults.get(k), list) for k in ("layer_types", "layers_block_type", "block_types")) else 2
    kwargs = shrink(defaults, layers)
    for key, value in FIELDS.get(model_type, {}).items():  # a dict for a sub-config sets some of its fields
        kwargs[key] = {**kwargs[key], **value} if isinstance(value, dict) and isinstance(kwargs.get(key), dict) else value
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        kwargs.pop(key, None)
    config = config_class(**kwargs)
    torch.manual_seed(0)
    if model_type in DECODER_CONFIGS:
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config(config).eval()
    return AutoModelForCausalLM.from_config(config).eval()  # transformers' config class: transformers' model


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def tokenizer():
    """A byte-level BPE of 300 ids trained on the built-in samples, BOS (id 1) first: ids every tiny model has."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from gated_attention.analysis.samples import builtin_samples

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_IDS, special_tokens=["<pad>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s.text for s in builtin_samples(1)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>")


def reference_f_attn(model, tok, samples, layers: list[int], num_layers: int) -> list[float] | str:
    """F-Attn of each attention row (`layers`: its layer, once per attention block: a layer with two blocks is listed
    twice) from transformers' own `output_attentions=True` (every submodel eager) on analyze's inputs, or why there
    is none. transformers returns one map per block call, in order."""
    import torch

    from gated_attention.analysis.capture import eager_attention, torch_linear_attention

    per_row: list[list] = [[] for _ in layers]
    with torch.no_grad(), torch_linear_attention(model), eager_attention(model):
        for sample in samples:
            ids = tok(sample.text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")["input_ids"]
            maps = [a for a in model(input_ids=ids, output_attentions=True, use_cache=False).attentions or ()
                    if isinstance(a, torch.Tensor) and a.dim() == 4]
            if len(maps) == num_layers != len(layers):  # transformers also records linear attention (MiniMax's)
                maps = [maps[f - 1] for f in layers]
            if len(maps) != len(layers):
                return f"{len(layers)} attention blocks, transformers returns {len(maps)} maps"
            for row, a in zip(per_row, maps):
                row.append(a[0, :, 1:, 0].double().mean(-1))
    return [torch.stack(v).mean().item() for v in per_row]


MAX_LENGTH = 24


def outcome(model_type: str, tok, samples) -> tuple[str, str]:
    """(class, detail): exact / none / refused (as `analyze` would: one line, exit 2) / mismatch / error (a
    traceback `analyze` would show) / build failed (the catalog's own limit)."""
    import csv
    import tempfile

    from gated_attention.analysis.analyze import run_analysis
    from gated_attention.analysis.layout import model_layout

    try:
        model = build(model_type)
    except Exception as e:  # noqa: BLE001 - the catalog's own limit, reported as such
        return "build failed", first_line(e)
    with tempfile.TemporaryDirectory() as out:
        try:
            run_analysis(model, tok, samples, out, max_length=MAX_LENGTH, n_bootstrap=10)
        except ValueError as e:  # what `analyze` says in one line, exit 2
            return "refused", str(e).splitlines()[0]
        except Exception as e:  # noqa: BLE001 - a traceback `analyze` would show
            return "error", first_line(e)
        with open(f"{out}/layers.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["is_attention"] == "True"]
    layout = model_layout(model)
    if not rows:
        return NONE, f"{layout.num_layers} layers"
    fa = [int(r["layer"]) for r in rows]
    try:
        reference = reference_f_attn(model, tok, samples, fa, layout.num_layers)
    except Exception as e:  # noqa: BLE001
        return "no reference", first_line(e)
    if isinstance(reference, str):
        return "mismatch", reference
    diff = max(abs(float(r["f_attn"]) - value) for value, r in zip(reference, rows))
    if not diff <= 1e-6:
        return "mismatch", f"F-Attn differs by {diff:.2g}"
    gates = f"; gates `{next(iter(layout.gates.values())).name}` in {sorted(layout.gates)}" if layout.gates else ""
    passes = max(layout.passes, default=1)
    loops = f" ({len(set(layout.names))} modules, up to {passes} passes each)" if passes > 1 else ""
    blocks = f", {len(rows)} attention blocks" if len(rows) > len(set(fa)) else ""
    return EXACT, f"{len(set(fa))} of {layout.num_layers} layers{loops}{blocks}{gates}; F-Attn within {diff:.0e}"


def expected(model_type: str) -> str | None:
    for kind, types in ((EXACT, EXPECTED_EXACT), (NONE, EXPECTED_NONE), ("refused", EXPECTED_REFUSED),
                        ("build failed", EXPECTED_NOT_BUILT), ("error", EXPECTED_ERROR)):
        if model_type in types:
            return kind
    return None


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*", help="model types (default: all)")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    args = p.parse_args(argv)
    from transformers.utils import logging

    from gated_attention.analysis.samples import builtin_samples

    logging.set_verbosity_error()
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    tok, samples = tokenizer(), builtin_samples(1)
    rows, start = [], time.perf_counter()
    for model_type in types:
        t0 = time.perf_counter()
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            kind, detail = outcome(model_type, tok, samples)
        want = expected(model_type)
        if want is None:
            flag = "NEW"
        elif kind != want or (kind == "refused" and EXPECTED_REFUSED[model_type] not in detail):
            flag = "UNEXPECTED"
        else:
            flag = ""
        rows.append((model_type, kind, want or "", flag, detail))
        print(f"{model_type:<28} {kind:<14} {flag:<10} {detail}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    total = time.perf_counter() - start
    counts: dict[str, int] = {}
    for _, kind, _, _, _ in rows:
        counts[kind] = counts.get(kind, 0) + 1
    print(f"\n{len(rows)} model types in {total:.0f} s: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    flagged = [r for r in rows if r[3]]
    print(f"flagged: {len(flagged)} ({', '.join(r[0] for r in flagged) or 'none'})")
    if args.markdown:
        write_markdown(args.markdown, rows, counts, total)
    return 1 if any(r[3] == "UNEXPECTED" for r in rows) else 0


def write_markdown(path: str, rows, counts, seconds: float) -> None:
    import transformers

    words = {EXACT: "exact", NONE: "no softmax attention", "refused": "refused in one line (exit 2, nothing written)",
             "build failed": "not built by the catalog (its tiny-config rules; not analysed)",
             "error": "a traceback"}
    lines = [
        "# `analyze` on every causal LM transformers ships",
        "",
        f"Written by `python benchmarks/analyze_catalog.py --markdown docs/analyze_catalog.md` with transformers "
        f"{transformers.__version__} ({len(rows)} model types of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {seconds:.0f} s "
        "on 2 CPU cores). Each type is a tiny random model; \"exact\" means `analyze` ran and every attention "
        "layer's F-Attn in its `layers.csv` equals transformers' own `output_attentions=True` on the same inputs "
        "within 1e-6 (see the script's docstring).",
        "",
        *(f"- {words.get(kind, kind)}: {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])),
        "",
        "| model type | outcome | detail |",
        "|---|---|---|",
    ]
    for model_type, kind, _, flag, detail in rows:
        lines.append(f"| `{model_type}` | {kind}{' (' + flag + ')' if flag else ''} | {detail.replace('|', '/')} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
