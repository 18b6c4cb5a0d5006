"""Export a gated model to transformers' native Qwen3.5 text layout (`Qwen3_5ForCausalLM`).

Qwen3.5's full-attention layer is our G1 elementwise sigmoid gate with the
gate's projection stored inside `q_proj`; its RMSNorms multiply by `(1 + w)`;
its q/k norms always exist; its RoPE rotates the whole head when
`partial_rotary_factor` is 1.0. How each tensor maps, and the config layouts
the engines read (`LAYOUTS`: `text` for transformers, vLLM and llama.cpp,
`mlx` for mlx-lm), are records in `export_layouts`; this module checks a model
against them, applies them (`plan_export`, `_write_config`) and verifies the result.

Only models where every piece maps exactly are exported; anything else is
refused with the reason (another gate position or activation, no q/k norm, a
sliding window, a gate bias without attention biases, ...). Norm weights are
checked one by one: `1 + (w - 1)` must give back w exactly in the stored dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .. import GatedAttentionWarning, register_auto_classes
from ..configuration.gate_spec import gate_score_shape
from ..memory.budget import MemoryBudget
from .card import write_export_card
from .export_layouts import (
    ARCHITECTURE,
    CONFIG_LAYOUTS,
    LAYOUTS,
    QWEN3_5_WEIGHTS,
    ConfigLayout,
    WeightRule,
    ZeroFill,
    llama_cpp_limit,
    mlx_lm_limit,
    qwen3_5_tokenizer_difference,
)
from .pipeline import ConversionPlan, Result, Verification, run
from .shapes import expected_shapes
from .source_config import check_config_types
from .sources import ConversionError, SourceCheckpoint, read_config_dict
from .verify import compare_runs, prompt_reserve, run_prompt
from .writer import OutputTensor

FORMATS = ("qwen3_5",)
EXPORTABLE = ("gated_attention", "gated_deltanet_hybrid")


def serving_route(model_type: str | None) -> str:
    """Where a model that cannot be exported is still served (README, "Serve")."""
    if model_type == "gated_deltanet_hybrid":
        return ("no serving engine runs this hybrid as it is: vLLM's transformers backend refuses Gated DeltaNet "
                "layers (they bypass the attention interface), so it runs in transformers only")
    return ("serve the gated checkpoint itself with vLLM's transformers backend instead "
            "(LLM(path, model_impl=\"transformers\", trust_remote_code=True); README, Serve)")


def refuse_export(reason: str, model_type: str | None):
    raise ConversionError(f"cannot export to qwen3_5 exactly: {reason}; {serving_route(model_type)}")


def check_exportable(config) -> None:
    """Raise ConversionError saying why `config` has no exact Qwen3.5 equivalent, and which route remains."""

    def refuse(reason: str):
        refuse_export(reason, config.model_type)

    if config.model_type not in EXPORTABLE:
        refuse(f"model_type {config.model_type!r} is not supported (supported: {', '.join(EXPORTABLE)})")
    if config.model_type == "gated_deltanet_hybrid":
        if config.num_experts > 0:
            refuse("the hybrid has MoE MLPs; Qwen3.5's text model has dense MLPs")
        if not config.linear_output_gate:
            refuse("Qwen3.5's Gated DeltaNet always has its output gate; this model has linear_output_gate=false")
    if all(t == "linear_attention" for t in config.layer_types):
        return  # no attention layer: nothing below applies
    spec = config.attn_gate
    if spec["position"] != "sdpa":
        refuse(f"Qwen3.5 gates the SDPA output (G1) only; this model's gate position is {spec['position']!r}")
    if spec["mode"] != "multiplicative" or spec["activation"] != "sigmoid":
        refuse(f"Qwen3.5's gate is a multiplicative sigmoid; this model's is {spec['mode']} {spec['activation']}")
    if not spec["input_dependent"]:
        refuse("Qwen3.5's gate is input-dependent; this model's gate is a learned constant")
    if spec["rank"] is not None:
        refuse(f"Qwen3.5's gate is a full block of q_proj; this model's has rank {spec['rank']}, and multiplying its "
               "two factors out rounds")
    if config.attention_sinks:
        refuse("Qwen3.5's attention has no learned sinks; this model has attention_sinks=true")
    if spec["bias"] and not config.attention_bias:
        refuse("the gate has a bias, but Qwen3.5 keeps gate and query in one q_proj, which has no bias here (attention_bias=false)")
    if not config.qk_norm:
        refuse("Qwen3.5 always applies RMSNorm to q and k; this model has qk_norm=false")
    if config.sliding_window is not None or "sliding_attention" in config.layer_types:
        refuse("Qwen3.5 attention has no sliding window")
    if config.attn_output_norm is not None or config.attn_output_activation is not None:
        refuse("Qwen3.5 has no norm or activation on the SDPA output")
    if config.mlp_bias:
        refuse("Qwen3.5's MLP has no bias")
    # qkv_bias without attention_bias (Qwen2) maps too: Qwen3.5 then gets a zero o_proj bias (adding 0 is exact).


LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def qwen3_5_config(config):
    from transformers import Qwen3_5TextConfig

    # Our RoPE rotates the whole head. Qwen3.5 defaults to a quarter, at the top level (transformers 5.17-5.23
    # write it to config.json beside rope_parameters): both say 1.0, so no engine can read the other one.
    rope = {**config.rope_parameters, "partial_rotary_factor": 1.0}
    out = Qwen3_5TextConfig(
        partial_rotary_factor=1.0,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        use_cache=config.use_cache,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
        attention_bias=config.attention_bias or config.qkv_bias,
        attention_dropout=config.attention_dropout,
        layer_types=list(config.layer_types),
        **{k: getattr(config, k) for k in LINEAR_FIELDS if hasattr(config, k)},
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    out.dtype = config.dtype
    return out


# --- the weights: `export_layouts.QWEN3_5_WEIGHTS` applied -------------------------------------------------


def _norm_minus_one(ckpt: SourceCheckpoint, names: list[str], config) -> torch.Tensor:
    name = names[0]
    w = ckpt.read(name)
    shifted = (w.float() - 1.0).to(w.dtype)
    if not torch.equal(1.0 + shifted.float(), w.float()):
        bad = (1.0 + shifted.float() != w.float()).nonzero()[0].item()
        raise ConversionError(
            f"cannot export to qwen3_5 exactly: norm weight {name}[{bad}] = {w[bad].item()!r} is not 1 + w for any {w.dtype} w; "
            "convert SRC's source with --dtype float32 and export that"
        )
    return shifted


def _q_with_gate(ckpt: SourceCheckpoint, names: list[str | None], config) -> torch.Tensor:
    """Interleave query and gate per head: `[H * 2D, ...]`, head h = (D query rows, D gate rows)."""
    q_name, gate_name = names
    H, D = config.num_attention_heads, config.head_dim
    q = ckpt.read(q_name)
    trailing = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
    if gate_name is None:  # no gate bias: zeros, since Qwen3.5's q_proj bias covers both halves
        g = torch.zeros((H, D, *trailing), dtype=q.dtype)
    else:
        # A headwise score (one per head) or a head-shared one is the elementwise gate with repeated rows.
        scores = gate_score_shape(config.attn_gate, config.hidden_size, H, config.num_key_value_heads, D)  # (heads, width)
        g = ckpt.read(gate_name).to(q.dtype)
        if trailing and g.shape[-1] < trailing[0]:  # a gate reading X's first `input_channels`: zeros for the rest
            g = torch.nn.functional.pad(g, (0, trailing[0] - g.shape[-1]))
        g = g.view(*scores, *trailing).expand(H, D, *trailing)
    out = torch.cat([q.view(H, D, *trailing), g], dim=1)  # [H, 2D, ...]
    return out.reshape(H * 2 * D, *trailing)


def _concat(ckpt: SourceCheckpoint, names: list[str], config):
    for name in names:  # concatenation along dim 0 is the parts' bytes in order
        yield ckpt.read(name)


@dataclass(frozen=True)
class Op:
    """A `WeightRule.op`: the output's shape from its sources' shapes, and `make(ckpt, names, config)`, where
    `names` are the rule's sources in SRC (None for one SRC lacks)."""

    shape: Callable[[list[tuple[int, ...]]], tuple[int, ...]]
    make: Callable
    every_source: bool = False  # refuse when SRC lacks one


OPS = {
    "copy": Op(lambda shapes: shapes[0], lambda ckpt, names, config: ckpt.read(names[0])),
    "minus_one": Op(lambda shapes: shapes[0], _norm_minus_one),
    "concat": Op(lambda shapes: (sum(s[0] for s in shapes), *shapes[0][1:]), _concat, every_source=True),
    "q_with_gate": Op(lambda shapes: (2 * shapes[0][0], *shapes[0][1:]), _q_with_gate),
}


def plan_export(ckpt: SourceCheckpoint, config, model) -> list[OutputTensor]:
    """SRC's tensors through `QWEN3_5_WEIGHTS`, in SRC's order, each checked against the (meta) `model`."""
    expected = expected_shapes(model)
    rules = [r for r in QWEN3_5_WEIGHTS if isinstance(r, WeightRule)]
    fills = [r for r in QWEN3_5_WEIGHTS if isinstance(r, ZeroFill)]
    travelling = tuple(source for r in rules for source in r.sources[1:])
    outputs: list[OutputTensor] = []
    for name, info in ckpt.tensors.items():
        if name.endswith(travelling) or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue  # written with the tensor they travel with (gates inside q_proj); tied, lm_head is embed_tokens
        rule = next(r for r in rules if name.endswith(r.sources[0]))
        prefix = name[: len(name) - len(rule.sources[0])]
        names = [prefix + s if prefix + s in ckpt.tensors else None for s in rule.sources]
        op, target = OPS[rule.op], rule.output(prefix)
        if op.every_source and None in names:
            raise ConversionError(f"SRC lacks tensor {prefix + rule.sources[names.index(None)]}")
        shape = op.shape([ckpt.tensors[n].shape for n in names if n is not None])
        if target not in expected:
            raise ConversionError(f"SRC tensor {name} has no place in {ARCHITECTURE}")
        if shape != expected[target]:
            raise ConversionError(f"tensor {target} would have shape {list(shape)}, Qwen3.5 expects {list(expected[target])}")
        outputs.append(OutputTensor(target, shape, info.dtype, partial(op.make, ckpt, names, config), [n for n in names if n]))
        for fill in fills:
            zero = name.removesuffix(fill.after) + fill.target
            if name.endswith(fill.after) and zero in expected and zero not in ckpt.tensors:
                outputs.append(OutputTensor(zero, expected[zero], info.dtype, partial(torch.zeros, expected[zero], dtype=info.dtype)))
    missing = set(expected) - {o.name for o in outputs}
    if missing:
        raise ConversionError(f"SRC lacks tensor {sorted(missing)[0]}, which {ARCHITECTURE} needs")
    return outputs


@contextlib.contextmanager
def qwen3_5_torch_path():
    """Run transformers' Qwen3.5 Gated DeltaNet on its own torch functions while inside.

    transformers routes Qwen3.5's delta rule and convolutions to fla's Triton
    kernels whenever fla imports, and those fail without a GPU (see docs/architecture.md,
    "Pitfalls worth knowing"); verification runs on the CPU, so it unwraps them for its forward.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
    saved = {n: getattr(q, n) for n in names}
    try:
        for n, fn in saved.items():
            setattr(q, n, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(q, n, fn)


def _verify(folder: Path, stage: Path, config, log, budget: MemoryBudget) -> float:
    """Compare in float32, where the two layouts compute the same numbers.

    In bf16 they round differently by design: Llama-style norms cast to bf16
    before multiplying by w, Qwen3.5's multiply by (1 + w) in fp32 first; so a
    bf16 comparison would mix the mapping's correctness with rounding order.
    The two are loaded one after the other within `budget`, as `convert` verifies.
    """
    log(f"verifying within {budget.describe()}: SRC (gated), then the export (native Qwen3.5), in float32, "
        "comparing logits on a fixed prompt")  # fmt: skip
    prompt = dict(dtype=torch.float32, vocab_size=config.vocab_size, max_positions=config.max_position_embeddings,
                  offload_dir=stage, reserve=prompt_reserve(config, torch.float32))  # fmt: skip
    reference = run_prompt(folder, budget, log=log, **prompt)
    log(f"verifying: SRC ran with {reference.placement()}")
    native = run_prompt(stage, budget, forward_context=qwen3_5_torch_path, log=log, **prompt)
    log(f"verifying: DST ran with {native.placement()}")
    cmp = compare_runs(reference, native)
    diff, equal, scale = cmp.max_abs_diff, torch.equal(reference.logits, native.logits), cmp.max_abs_logit
    log(f"verify: max |logits(SRC) - logits(DST)| = {diff:g}" + (" (bit-identical)" if equal else f" (max |logits| {scale:g})"))
    # Same products and sums; only the GEMM's summation order may differ (e.g. a headwise gate becomes D equal rows).
    if diff > 1e-5 * max(scale, 1.0):
        raise ConversionError(f"verification failed: the exported model's logits differ by {diff:g} in float32")
    return diff


def export_checkpoint(
    src: str,
    dst: str | Path,
    *,
    format: str = "qwen3_5",
    layout: str = "text",
    overwrite: bool = False,
    verify: bool = True,
    max_memory: int | None = None,
    max_shard_size: int | str = "5GB",
    revision: str | None = None,
    log=print,
) -> Result:
    """Write `src` (a gated dense or hybrid checkpoint) as a native transformers Qwen3.5 text checkpoint.

    `layout` picks the config layout (`LAYOUTS`): "text" for transformers, vLLM and llama.cpp; "mlx" for mlx-lm.
    Verified (when `verify`) within `max_memory` bytes (default: what is free when it starts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_auto_classes()  # AutoConfig and AutoModelForCausalLM read SRC's gated checkpoint below

    if format not in FORMATS:
        raise ConversionError(f"--format {format!r} is not supported; supported: {', '.join(FORMATS)}")
    if layout not in LAYOUTS:
        raise ConversionError(f"--layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
    config_layout = CONFIG_LAYOUTS[layout]

    def prepare(folder: Path, dst: Path) -> ConversionPlan:
        check_config_types(folder)
        model_type = read_config_dict(folder).get("model_type")
        if model_type not in EXPORTABLE:
            refuse_export(f"SRC model_type {model_type!r} is not supported (supported: {', '.join(EXPORTABLE)})", model_type)
        config = AutoConfig.from_pretrained(folder)
        check_exportable(config)
        ckpt = SourceCheckpoint(folder)
        target = qwen3_5_config(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target)
        outputs = plan_export(ckpt, config, model)
        if why := mlx_lm_limit(config.layer_types, getattr(config, "linear_conv_kernel_dim", None)):
            notes.append(f"mlx-lm will not run this export: {why}")
        interval = config_layout.text_keys.get("full_attention_interval", lambda _: None)(config.layer_types)
        if why := llama_cpp_limit(config.layer_types, interval):
            notes.append(why)
        if config_layout.qwen3_5_tokenizer and (why := qwen3_5_tokenizer_difference(folder)):
            notes.append(why)
        return ConversionPlan(
            ckpt,
            outputs,
            announce=f"exporting {src} -> {dst} as {ARCHITECTURE} ({config_layout.describe()})",
            desc="exporting",
            write_config=partial(_write_config, target=target, layout=config_layout),
            write_card=partial(write_export_card, src=src, config=config, layout=layout),
            # verified in float32 (see `_verify`)
            verification=Verification(target, torch.float32, partial(_verify, folder, config=config, log=log)),
            finite=ckpt.tensors,  # the gates too: they travel inside q_proj
        )

    notes: list[str] = []  # what an engine will make of the export, found while planning it
    result = run(src, dst, prepare, verify=verify, max_memory=max_memory, overwrite=overwrite,
                 max_shard_size=max_shard_size, revision=revision, log=log)
    # Warnings, not refusals (the export is exact, and other engines may serve it), and only once DST is
    # written: input refused later in the run stays one line.
    for note in notes:
        warnings.warn(note, GatedAttentionWarning)
    return result


def _write_config(stage: Path, target, layout: ConfigLayout) -> None:
    """`target`, the text model's config, saved as `layout` says (`export_layouts.ConfigLayout`)."""
    for key, value_of in layout.text_keys.items():
        if (value := value_of(target.layer_types)) is not None:
            setattr(target, key, value)
    target.architectures = [ARCHITECTURE]
    if layout.model_type == target.model_type:
        target.save_pretrained(stage)
        return
    from transformers import AutoConfig

    outer = {layout.nested_under: target.to_dict(), **{key: getattr(target, key) for key in layout.outer_keys}}
    wrapper = AutoConfig.for_model(layout.model_type, **outer)
    wrapper.architectures = [ARCHITECTURE]
    wrapper.dtype = target.dtype
    wrapper.save_pretrained(stage)
