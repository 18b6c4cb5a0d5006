"""`gated-attention convert` and `gated-attention extend`: what they read, plan and write.

    SRC --(headers, config)--> plan --(one tensor at a time)--> staging folder --verify--> DST

The write sequence itself is `pipeline.run`; this module says how each
command reads SRC and plans its outputs, and what config, card and
verification it writes.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import torch

from ..configuration.declared import DECLARED_MODEL_TYPE
from ..configuration.gate_spec import DEFAULT_GATE_SPEC, check_gate_shape
from ..hub.gguf import read_record
from ..hub.remote_code import write_remote_code_for_config
from .card import write_conversion_card
from .declared import (DeclaredTarget, declared_extend_target, declared_model_type, declared_rope_change, declared_target,
                       refuse_gated_config, verify_declared)
from .families import GATED_RULES, detect_family, family_record
from .pipeline import ConversionPlan, Result, Verification, run
from .quantized import source_loader
from .plan import key_mapping, plan_weights
from .rope import RopeChange, apply_rope_change, rope_frequencies
from .shapes import target_shapes
from .source_config import GATED_MODEL_TYPES, load_gated_config, load_source_config
from .sources import ConversionError, SourceCheckpoint, read_config_dict
from .targets import target_config
from .verify import VERIFY_ATTENTION, verify_against_source, verify_against_ungated
from .writer import OutputTensor

__all__ = ["VERIFY_ATTENTION", "Result", "conversion_gate_spec", "convert_checkpoint", "extend_checkpoint"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def conversion_gate_spec(gate: str, init: str, rank: int | None = None, input_channels: int | None = None) -> dict:
    """The gate a conversion adds for `--gate`, `--init`, `--gate-rank` and `--gate-input-channels`: G1 sigmoid,
    a bias only for `--init bias`."""
    if gate not in ("elementwise", "headwise"):
        raise ConversionError(f"--gate {gate!r} is not supported; choose elementwise or headwise")
    if init not in ("exact", "bias"):
        raise ConversionError(f"--init {init!r} is not supported; choose exact or bias")
    for flag, value in (("--gate-rank", rank), ("--gate-input-channels", input_channels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConversionError(f"{flag} {value!r} is not allowed; give a positive int")
    # Exact init needs no bias (score = sigmoid(0) from a zero weight); the bias init is the bias.
    return {**DEFAULT_GATE_SPEC, "position": "sdpa", "granularity": gate, "bias": init == "bias", "rank": rank,
            "input_channels": input_channels}


def _gated_config(src_config, family, gate_spec: dict):
    """`target_config` for SRC, its gate's rank and input width checked against SRC's widths first: a wrong
    flag is the flag's error, not SRC's."""
    if gate_spec is None or (gate_spec.get("rank") is None and gate_spec.get("input_channels") is None):
        return target_config(src_config, family, gate_spec)
    config = target_config(src_config, family, {**gate_spec, "rank": None, "input_channels": None})
    try:
        check_gate_shape(gate_spec, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim)
    except ValueError as e:
        raise ConversionError(f"{e} (--gate-rank, --gate-input-channels)") from None
    return target_config(src_config, family, gate_spec)


def planned_gate(family, src_config, gate: str | None, init: str, rank: int | None = None,
                 input_channels: int | None = None) -> tuple[dict | None, str]:
    """The gate DST gets, and the plan's init for it.

    A source without a gate of its own gets `--gate` (elementwise when not given) with `--init`, `--gate-rank`
    and `--gate-input-channels`. A source with one (the paper's checkpoints, `Family.gate`) keeps it as trained,
    its weights copied: a `--gate` that names another granularity, `--init bias` or a new gate's shape is
    refused. One whose own gate is none (the paper's baseline) stays ungated unless `--gate` asks for one, which
    then starts exactly as any conversion's.
    """
    if family.gate is None:
        return conversion_gate_spec(gate or "elementwise", init, rank, input_channels), init
    own = family.gate(src_config)
    if own is None:
        return (conversion_gate_spec(gate, init, rank, input_channels), init) if gate else (None, "copy")
    if rank is not None or input_channels is not None:
        raise ConversionError(f"--gate-rank and --gate-input-channels shape a new gate, and SRC has its own "
                              f"{own['granularity']} gate, which is kept as trained; leave them out")
    if gate is not None and gate != own["granularity"]:
        raise ConversionError(f"--gate {gate} contradicts SRC's own {own['granularity']} gate ({family}); "
                              "leave --gate out to keep it")
    if init != "exact":
        raise ConversionError(f"--init {init} sets up a new gate, and SRC has its own {own['granularity']} gate, "
                              "which is kept as trained; leave --init out")
    return own, "copy"


def _describe_gate(spec: dict | None, init: str) -> str:
    if spec is None:
        return "no gate"
    if init == "copy":
        return f"its own {spec['granularity']} gate, kept"
    return f"gate {spec['granularity']}, init {init}"


def _requested_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype in (None, "auto"):
        return None
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _config_dtype(outputs: list[OutputTensor], requested: torch.dtype | None, source_dtype) -> str:
    if requested is not None:
        return str(requested).removeprefix("torch.")
    if source_dtype:
        return str(source_dtype).removeprefix("torch.")
    floats = [o for o in outputs if o.dtype.is_floating_point]
    dominant = max(floats, key=lambda o: o.nbytes).dtype if floats else torch.float32
    return str(dominant).removeprefix("torch.")


def _write_config_and_code(stage: Path, config, dtype_name: str, declared: bool = False) -> None:
    if declared:  # flat modeling files; sets config.auto_map and architectures
        from ..modeling.declared import write_declared_remote_code

        write_declared_remote_code(stage, config)
    else:
        write_remote_code_for_config(stage, config)
    config.dtype = dtype_name
    config.save_pretrained(stage)


def _declared_plan(folder: Path, ckpt: SourceCheckpoint, target: DeclaredTarget, *, init: str, requested, rope: RopeChange,
                   announce, card: dict, log) -> ConversionPlan:
    """The plan of a source gated by declaration (`declared.py`): SRC's tensors, the gates, SRC's own classes."""
    overrides = declared_rope_change(target, rope)
    rules = target.rules if init != "copy" else ()
    outputs = plan_weights(ckpt, target.expected, target.config, init=init, dtype=requested, rules=rules)
    dtype_name = _config_dtype(outputs, requested, getattr(target.source_config, "dtype", None))
    check = partial(verify_declared, folder, target=target, dtype=requested, overrides=overrides,
                    exact=init != "bias", log=log, quantization=ckpt.quantization)  # fmt: skip
    first = target.sites[0]
    return ConversionPlan(
        ckpt,
        outputs,
        announce=announce(dtype_name),
        desc="converting" if init != "copy" else "copying",
        write_config=partial(_write_config_and_code, config=target.config, dtype_name=dtype_name, declared=True),
        write_card=partial(write_conversion_card, init=None if init == "copy" else init, dtype_name=dtype_name,
                           rope=rope, config=target.config, gguf=read_record(folder),
                           gate_name=re.sub(r"\.\d+\.", ".*.", f"{first.path}.attn_gate"), output_name=first.output,
                           **card),
        verification=Verification(target.config, requested or getattr(torch, dtype_name), check),
        finite=target.finite(outputs),
    )  # fmt: skip


def _source(folder: Path, config_dict: dict, allow_pickle: bool, requested) -> SourceCheckpoint:
    """SRC's tensors; a quantized SRC's weights dequantized as they are read (`quantized.py`), to `--dtype` or
    float32 (`_quantized_dtype`)."""
    quantization = config_dict.get("quantization_config")
    return SourceCheckpoint(folder, allow_pickle=allow_pickle, quantization=quantization,
                            dequantize_to=requested or torch.float32)


def _quantized_dtype(ckpt: SourceCheckpoint, requested):
    """The dtype DST is written in: `--dtype`, or float32 for a quantized SRC (its dequantized weights exactly)."""
    return requested if requested is not None or ckpt.quantization is None else torch.float32


# --- convert -----------------------------------------------------------------------------------------


def convert_checkpoint(
    src: str,
    dst: str | Path,
    *,
    gate: str | None = None,
    init: str = "exact",
    gate_rank: int | None = None,
    gate_input_channels: int | None = None,
    dtype: str | None = None,
    rope: RopeChange = RopeChange(),
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool = True,
    max_memory: int | None = None,
    max_shard_size: int | str = "5GB",
    revision: str | None = None,
    log=print,
) -> Result:
    """Convert a Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, Phi-3 or fla Gated DeltaNet hybrid checkpoint,
    or one of the Gated Attention paper's own, a folder, a Hub id or a GGUF file (dequantized by transformers'
    GGUF loader to `dtype`, float32 by default).

    `gate` (elementwise or headwise; None: elementwise, or the source's own gate, `planned_gate`) is the gate
    added. With `init="exact"` the result's logits are bit-identical to the source's
    (checked when `verify`, after every layer), in the source dtype or in `dtype`.
    The check runs within `max_memory` bytes (default: what is free when it starts).
    """
    conversion_gate_spec(gate or "elementwise", init, gate_rank, gate_input_channels)  # a wrong flag, before anything is read
    requested = _requested_dtype(dtype)

    def prepare(folder: Path, dst: Path) -> ConversionPlan:
        config_dict = read_config_dict(folder)
        family = family_record(config_dict)  # the records first: the declared route is asked only where none answers
        if family is None and (model_type := declared_model_type(config_dict)) is not None:
            refuse_gated_config(config_dict)
            ckpt = _source(folder, config_dict, allow_pickle, requested)
            want = _quantized_dtype(ckpt, requested)
            target = declared_target(folder, ckpt, model_type, conversion_gate_spec(gate or "elementwise", init, gate_rank,
                                                                                    gate_input_channels))
            if ckpt.quantization is not None and hasattr(target.config, "quantization_config"):
                del target.config.quantization_config  # DST holds the dequantized weights
            name = f"{model_type} ({target.source_class.__name__})"
            announce = lambda dtype_name: (f"converting {name} checkpoint {src} -> {dst} by declaration, "  # noqa: E731
                                           f"{target.describe()} (gate {gate or 'elementwise'}, init {init}, "
                                           f"dtype {dtype_name})")
            return _declared_plan(folder, ckpt, target, init=init, requested=want, rope=rope, announce=announce,
                                  card=dict(src=src, family_name=name, command="convert",
                                            quantization=ckpt.quantization), log=log)  # fmt: skip
        family = family or detect_family(config_dict)
        ckpt = _source(folder, config_dict, allow_pickle, requested)
        want = _quantized_dtype(ckpt, requested)
        src_config = load_source_config(folder, family)
        gate_spec, plan_init = planned_gate(family, src_config, gate, init, gate_rank, gate_input_channels)
        config = _gated_config(src_config, family, gate_spec)
        rope_parameters, max_positions = apply_rope_change(config.rope_parameters, config.max_position_embeddings, rope)
        config.rope_parameters, config.max_position_embeddings = rope_parameters, max_positions
        outputs = plan_weights(ckpt, target_shapes(config), config, init=plan_init, dtype=want,
                               rules=family.rules, source=src_config)  # fmt: skip
        dtype_name = _config_dtype(outputs, want, getattr(src_config, "dtype", None))
        exact = init == "exact"
        reference, done = family.reference(src_config), []
        if reference is None:
            check = None
            if verify:
                done.append(f"verify: skipped: no transformers class runs SRC's layout ({family}; its own code "
                            "needs transformers 4.5x); the package's tests check this conversion against outputs "
                            "of that code")
        elif family.kind == "hybrid":
            mapping = key_mapping(family.rules, src_config, config.num_hidden_layers)
            check = partial(verify_against_ungated, ckpt, config=config, key_mapping=mapping, dtype=want,
                            exact=exact, log=log)  # fmt: skip
        else:
            overrides = {} if rope.empty else {"rope_parameters": rope_parameters, "max_position_embeddings": max_positions}
            check = partial(verify_against_source, folder, config=config, dtype=want, overrides=overrides,
                            exact=exact, log=log, reference_kwargs=reference,
                            source_class=source_loader(None, ckpt.quantization))  # fmt: skip
        return ConversionPlan(
            ckpt,
            outputs,
            announce=f"converting {family} checkpoint {src} -> {dst} ({_describe_gate(gate_spec, plan_init)}, "
                     f"dtype {dtype_name})",
            desc="converting",
            write_config=partial(_write_config_and_code, config=config, dtype_name=dtype_name),
            write_card=partial(write_conversion_card, src=src, family_name=family.name, init=plan_init,
                               dtype_name=dtype_name, rope=rope, config=config, command="convert",
                               gguf=read_record(folder), quantization=ckpt.quantization),
            # DST's layers hold SRC's and the gates: if the budget holds DST's largest layer, it holds SRC's.
            verification=check and Verification(config, want or getattr(torch, dtype_name), check),
            done=done,
        )  # fmt: skip

    return run(src, dst, prepare, verify=verify, max_memory=max_memory, overwrite=overwrite,
               max_shard_size=max_shard_size, revision=revision, log=log, allow_pickle=allow_pickle, count_shards=True,
               takes_gguf=True, dequantize_to=requested)  # fmt: skip


# --- extend ------------------------------------------------------------------------------------------


def extend_checkpoint(
    src: str,
    dst: str | Path,
    *,
    rope: RopeChange,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_memory: int | None = None,
    max_shard_size: int | str = "5GB",
    revision: str | None = None,
    log=print,
) -> Result:
    """Change the RoPE base and/or apply YaRN to a gated checkpoint; weights are copied unchanged.

    Verified (when `verify`) within `max_memory` bytes, as `convert_checkpoint` is."""
    rope.check_not_empty()
    requested = _requested_dtype(dtype)

    def prepare(folder: Path, dst: Path) -> ConversionPlan:
        config_dict = read_config_dict(folder)
        if config_dict.get("model_type") == DECLARED_MODEL_TYPE:
            ckpt = SourceCheckpoint(folder)
            target = declared_extend_target(folder, ckpt)
            return _declared_plan(folder, ckpt, target, init="copy", requested=requested, rope=rope,
                                  announce=lambda dtype_name: f"extending {src} -> {dst}: {rope.describe()}", card=dict(
                                      src=src, family_name=config_dict.get("source_model_type"), command="extend"),
                                  log=log)  # fmt: skip
        if config_dict.get("model_type") not in GATED_MODEL_TYPES:
            detect_family(config_dict)  # names the architecture and the supported list
            raise ConversionError(
                f"SRC is a {config_dict.get('model_type')} model, not a gated one; use `gated-attention convert` "
                "with --rope-theta / --yarn-factor"
            )
        ckpt = SourceCheckpoint(folder)
        config = load_gated_config(folder)
        config.auto_map = {}  # rewritten from the installed package below
        rope_parameters, max_positions = apply_rope_change(config.rope_parameters, config.max_position_embeddings, rope)
        config.rope_parameters, config.max_position_embeddings = rope_parameters, max_positions
        outputs = plan_weights(ckpt, target_shapes(config), config, init="copy", dtype=requested, rules=GATED_RULES)
        dtype_name = _config_dtype(outputs, requested, getattr(config, "dtype", None))
        overrides = {"rope_parameters": rope_parameters, "max_position_embeddings": max_positions}
        check = partial(verify_against_source, folder, config=config, dtype=requested, overrides=overrides,
                        exact=True, log=log)  # fmt: skip
        inv_freq, attention_factor = rope_frequencies(config)
        return ConversionPlan(
            ckpt,
            outputs,
            announce=f"extending {src} -> {dst}: {rope.describe()}",
            desc="copying",
            write_config=partial(_write_config_and_code, config=config, dtype_name=dtype_name),
            write_card=partial(write_conversion_card, src=src, family_name=config.model_type, init=None,
                               dtype_name=dtype_name, rope=rope, config=config, command="extend"),
            verification=Verification(config, requested or getattr(torch, dtype_name), check),
            done=[f"rope: {rope_parameters['rope_type']}, attention factor {attention_factor:g}, max positions {max_positions}"],
        )  # fmt: skip

    return run(src, dst, prepare, verify=verify, max_memory=max_memory, overwrite=overwrite,
               max_shard_size=max_shard_size, revision=revision, log=log)
