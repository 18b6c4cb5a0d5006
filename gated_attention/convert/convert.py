"""The streaming converter behind `gated-attention convert` and `gated-attention extend`.

    SRC --(headers, config)--> plan --(one tensor at a time)--> staging folder --verify--> DST

Everything that can be wrong with SRC (config, family, shards, shapes) is
checked while planning, before a byte is written. The staging folder becomes
DST only after the weights, config, remote code, side files and model card are
written and, unless `verify=False`, the logits have been compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__, register_auto_classes
from ..configuration.gate_spec import DEFAULT_GATE_SPEC
from ..hub.model_card import base_model_fields, options_rows, write_model_card
from ..hub.remote_code import write_remote_code_for_config
from .families import GATED_MODEL_TYPES, detect_family
from .plan import GATE_BIAS_INIT, plan_weights, source_to_target_name
from .shapes import dense_shapes, expected_shapes
from .source_config import check_field_types, load_source_config
from .targets import target_config
from .rope import RopeChange, apply_rope_change, rope_frequencies
from .sources import ConversionError, SourceCheckpoint, read_config_dict, resolve_source
from .folders import check_destination, staged_folder
from .writer import OutputTensor, copy_side_files, output_size, write_sharded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VERIFY_TOKENS = 32


@dataclass
class Result:
    dst: Path
    shards: list[str]
    max_abs_diff: float | None = None  # None when not verified


def conversion_gate_spec(gate: str, init: str) -> dict:
    """The gate a conversion adds for `--gate` and `--init`: G1 sigmoid, a bias only for `--init bias`."""
    if gate not in ("elementwise", "headwise"):
        raise ConversionError(f"--gate {gate!r} is not supported; choose elementwise or headwise")
    if init not in ("exact", "bias"):
        raise ConversionError(f"--init {init!r} is not supported; choose exact or bias")
    # Exact init needs no bias (score = sigmoid(0) from a zero weight); the bias init is the bias.
    return {**DEFAULT_GATE_SPEC, "position": "sdpa", "granularity": gate, "bias": init == "bias"}


def _requested_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype in (None, "auto"):
        return None
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _target_shapes(config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the target model's tensors.

    Dense: worked out from the config (`dense_shapes`), so that `--no-verify` imports no modeling code.
    MoE and hybrid: from the model built on the meta device (no memory), because their expert
    layout is whatever the installed transformers' Qwen3-MoE block is.
    """
    if config.model_type == "gated_attention":
        return dense_shapes(config)
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    with torch.device("meta"):
        return expected_shapes(AutoModelForCausalLM.from_config(config))


def _config_dtype(outputs: list[OutputTensor], requested: torch.dtype | None, source_dtype) -> str:
    if requested is not None:
        return str(requested).removeprefix("torch.")
    if source_dtype:
        return str(source_dtype).removeprefix("torch.")
    floats = [o for o in outputs if o.dtype.is_floating_point]
    dominant = max(floats, key=lambda o: o.nbytes).dtype if floats else torch.float32
    return str(dominant).removeprefix("torch.")


def _write_config_and_code(stage: Path, config, dtype_name: str) -> None:
    write_remote_code_for_config(stage, config)  # flat modeling files; sets config.auto_map and architectures
    config.dtype = dtype_name
    config.save_pretrained(stage)


# --- verification ----------------------------------------------------------------------------------


def verification_ids(vocab_size: int, max_positions: int) -> torch.Tensor:
    """A fixed prompt `[1, T]`: the same token ids on every machine, no tokenizer needed."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, min(VERIFY_TOKENS, max_positions)), generator=g)


@dataclass
class LogitsComparison:
    max_abs_diff: float
    bit_identical: bool
    max_abs_logit: float  # the scale the difference is measured against


@torch.no_grad()
def compare_logits(reference, result, vocab_size: int, max_positions: int) -> LogitsComparison:
    """Compare two models' logits on the fixed prompt."""
    ids = verification_ids(vocab_size, max_positions)
    a = reference.eval()(ids).logits
    b = result.eval()(ids).logits
    return LogitsComparison((a.float() - b.float()).abs().max().item(), torch.equal(a, b), a.abs().max().item())


# Both sides of a comparison run transformers' SDPA, so that a bit-identical conversion compares equal on
# any machine, whatever default either side's attention implementation has there.
VERIFY_ATTENTION = "sdpa"


def _load(folder: Path, dtype: torch.dtype | None, **config_overrides):
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype or "auto", attn_implementation=VERIFY_ATTENTION, **config_overrides
    )


def _verify(src_folder: Path, stage: Path, config, dtype, overrides: dict, exact: bool, log) -> float:
    # With a RoPE change the reference is SRC's weights run with DST's rotary tables: the change itself moves
    # the logits (that is its point), so only the weights' part can be compared, and the line says so.
    reference_name = "SRC" if not overrides else "SRC run with DST's rope_parameters"
    log(f"verifying: loading {reference_name} and the result, comparing logits on a fixed prompt")
    reference = _load(src_folder, dtype, **overrides)
    result = _load(stage, dtype)
    cmp = compare_logits(reference, result, config.vocab_size, config.max_position_embeddings)
    diff, equal = cmp.max_abs_diff, cmp.bit_identical
    del reference, result
    compared = f"max |logits({reference_name}) - logits(DST)| = {diff:g}"
    if exact:
        note = " (bit-identical)" if equal else ""
        if overrides:  # what a reader of "0" would otherwise take for "the RoPE change did nothing"
            note += "; DST's logits differ from SRC's own, as the RoPE change makes them"
        log(f"verify: {compared}{note}")
        if not equal:
            raise ConversionError(f"verification failed: exact conversion changed the logits (max abs diff {diff:g})")
    else:
        log(f"verify: {compared} (--init bias is near-identity, not exact)")
    return diff


def _verify_hybrid(ckpt: SourceCheckpoint, stage: Path, config, rename, dtype, exact: bool, log) -> float:
    """fla's own model runs only with CUDA kernels and flash-attn, so the reference is SRC's weights
    in our hybrid model with the gate off: this checks the gate init and every tensor's place, not
    fla's kernels against ours."""
    log("verifying: fla models need CUDA and flash-attn to run, so the reference is SRC's weights in "
        "gated_deltanet_hybrid with the gate off")
    ref_config = type(config).from_dict({**config.to_dict(), "attn_gate": None})
    # Built in the target dtype (not cast afterwards: .to() would also round RoPE's fp32 inv_freq buffer).
    target_dtype = dtype or getattr(torch, str(config.dtype))
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    reference = AutoModelForCausalLM.from_config(ref_config, dtype=target_dtype, attn_implementation=VERIFY_ATTENTION)
    state = {rename(name): ckpt.read(name) for name in ckpt.tensors if not (config.tie_word_embeddings and name == "lm_head.weight")}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"verification failed: SRC's weights do not fit the ungated model ({(missing + unexpected)[0]})")
    reference.tie_weights()
    result = _load(stage, dtype)
    cmp = compare_logits(reference, result, config.vocab_size, config.max_position_embeddings)
    del reference, result, state
    if exact:
        log(f"verify: max |logits(ungated) - logits(DST)| = {cmp.max_abs_diff:g}" + (" (bit-identical)" if cmp.bit_identical else ""))
        if not cmp.bit_identical:
            raise ConversionError(f"verification failed: exact conversion changed the logits (max abs diff {cmp.max_abs_diff:g})")
    else:
        log(f"verify: max |logits(ungated) - logits(DST)| = {cmp.max_abs_diff:g} (--init bias is near-identity, not exact)")
    return cmp.max_abs_diff


# --- convert -----------------------------------------------------------------------------------------


def convert_checkpoint(
    src: str,
    dst: str | Path,
    *,
    gate: str = "elementwise",
    init: str = "exact",
    dtype: str | None = None,
    rope: RopeChange = RopeChange(),
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
    revision: str | None = None,
    log=print,
) -> Result:
    """Convert a Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral or fla Gated DeltaNet hybrid checkpoint.

    With `init="exact"` the result's logits are bit-identical to the source's
    (checked when `verify`), in the source dtype or in `dtype`.
    """
    gate_spec = conversion_gate_spec(gate, init)
    requested = _requested_dtype(dtype)
    folder = resolve_source(src, revision=revision, allow_pickle=allow_pickle)
    dst = Path(dst)
    check_destination(folder, dst, overwrite)
    family = detect_family(read_config_dict(folder))
    ckpt = SourceCheckpoint(folder, allow_pickle=allow_pickle)
    src_config = load_source_config(folder, family)

    config = target_config(src_config, family, gate_spec)
    rope_parameters, max_positions = apply_rope_change(config.rope_parameters, config.max_position_embeddings, rope)
    config.rope_parameters, config.max_position_embeddings = rope_parameters, max_positions
    rename = src_config.target_name if family.kind == "hybrid" else source_to_target_name
    outputs = plan_weights(ckpt, _target_shapes(config), config, init=init, dtype=requested, rename=rename)
    ckpt.check_finite(name for o in outputs for name in o.sources)
    dtype_name = _config_dtype(outputs, requested, getattr(src_config, "dtype", None))

    log(f"converting {family} checkpoint {src} -> {dst} (gate {gate}, init {init}, dtype {dtype_name})")
    result = Result(dst, [])
    with staged_folder(dst, overwrite, log, size=output_size(outputs, folder)) as stage:
        result.shards = write_sharded(stage, outputs, max_shard_size=max_shard_size, desc="converting")
        _write_config_and_code(stage, config, dtype_name)
        copy_side_files(folder, stage)
        _write_card(stage, src, family.name, gate, init, dtype_name, rope, config, command="convert")
        if verify and family.kind == "hybrid":
            result.max_abs_diff = _verify_hybrid(ckpt, stage, config, rename, requested, init == "exact", log)
        elif verify:
            overrides = {} if rope.empty else {"rope_parameters": rope_parameters, "max_position_embeddings": max_positions}
            result.max_abs_diff = _verify(folder, stage, config, requested, overrides, init == "exact", log)
    log(f"wrote {dst} ({len(result.shards)} shard{'s' * (len(result.shards) > 1)})")
    return result


# --- extend ------------------------------------------------------------------------------------------


def _declared_types(config_class) -> dict:
    """Field -> type, as `config_class` and its bases up to transformers' PreTrainedConfig annotate them."""
    import inspect

    from transformers import PreTrainedConfig

    types = {}
    for klass in reversed(config_class.__mro__[: config_class.__mro__.index(PreTrainedConfig)]):
        types.update(inspect.get_annotations(klass, eval_str=True))  # our modules annotate with strings
    return types


def check_config_types(folder: Path) -> None:
    """Name a field of SRC's gated config.json whose value is not of the type its config class declares."""
    from transformers import AutoConfig

    raw = read_config_dict(folder)
    if raw.get("model_type") in GATED_MODEL_TYPES:
        register_auto_classes()
        check_field_types(raw, _declared_types(type(AutoConfig.for_model(raw["model_type"]))))


def load_gated_config(folder: Path):
    """SRC's gated config (`config.json` read by its class), with a field of the wrong type named."""
    from transformers import AutoConfig

    check_config_types(folder)
    try:
        return AutoConfig.from_pretrained(folder)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise ConversionError(f"SRC config.json does not describe a valid gated model: {e}") from None


def extend_checkpoint(
    src: str,
    dst: str | Path,
    *,
    rope: RopeChange,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str = "5GB",
    revision: str | None = None,
    log=print,
) -> Result:
    """Change the RoPE base and/or apply YaRN to a gated checkpoint; weights are copied unchanged."""
    rope.check_not_empty()
    requested = _requested_dtype(dtype)
    folder = resolve_source(src, revision=revision)
    dst = Path(dst)
    check_destination(folder, dst, overwrite)
    config_dict = read_config_dict(folder)
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
    outputs = plan_weights(ckpt, _target_shapes(config), config, init="copy", dtype=requested)
    ckpt.check_finite(name for o in outputs for name in o.sources)
    dtype_name = _config_dtype(outputs, requested, getattr(config, "dtype", None))

    log(f"extending {src} -> {dst}: {rope.describe()}")
    result = Result(dst, [])
    with staged_folder(dst, overwrite, log, size=output_size(outputs, folder)) as stage:
        result.shards = write_sharded(stage, outputs, max_shard_size=max_shard_size, desc="copying")
        _write_config_and_code(stage, config, dtype_name)
        copy_side_files(folder, stage)
        _write_card(stage, src, config.model_type, None, None, dtype_name, rope, config, command="extend")
        if verify:
            overrides = {"rope_parameters": rope_parameters, "max_position_embeddings": max_positions}
            result.max_abs_diff = _verify(folder, stage, config, requested, overrides, True, log)
    inv_freq, attention_factor = rope_frequencies(config)
    log(f"rope: {rope_parameters['rope_type']}, attention factor {attention_factor:g}, max positions {max_positions}")
    log(f"wrote {dst}")
    return result


# --- model card --------------------------------------------------------------------------------------


def _write_card(stage, src, family_name, gate, init, dtype_name, rope: RopeChange, config, command: str) -> None:
    options = {"source": src}
    changed = []
    if command == "convert":
        options.update({"--gate": gate, "--init": init})
        granularity = "one score per channel" if gate == "elementwise" else "one score per head"
        changed.append(
            f"- Every attention layer got a sigmoid output gate (G1, {gate}: {granularity}), "
            "`self_attn.attn_gate`, computed from the same normed hidden states as q/k/v."
        )
        if init == "exact":
            changed.append(
                "- Exact init: gate weight 0, so every gate score is sigmoid(0) = 0.5 exactly, and `o_proj` "
                "is doubled (exact in every float format). The logits equal the base model's bit for bit."
            )
        else:
            changed.append(
                f"- Bias init: gate weight 0 and gate bias {GATE_BIAS_INIT:g}, so every score is sigmoid"
                f"({GATE_BIAS_INIT:g}) = {torch.sigmoid(torch.tensor(GATE_BIAS_INIT)).item():.7f}; `o_proj` unchanged. "
                "Close to the base model, not equal, and the gate's gradient starts tiny (scaled by ~4.5e-5)."
            )
    options["--dtype"] = dtype_name
    if rope.rope_theta is not None:
        options["--rope-theta"] = rope.rope_theta
    if rope.yarn_factor is not None:
        options["--yarn-factor"] = rope.yarn_factor
        options["--original-max-position-embeddings"] = rope.original_max_position_embeddings
    if not rope.empty:
        changed.append(f"- RoPE: {rope.describe()}; `rope_parameters` = `{json.dumps(config.rope_parameters)}`, "
                       f"`max_position_embeddings` = {config.max_position_embeddings}.")
    if command == "extend":
        changed.append("- Weights are copied unchanged; only the position encoding changed.")
    changed.append("- `config.json` has an `auto_map` and the modeling code sits beside the weights (remote code).")
    title = f"{Path(str(src)).name} with gated attention" if command == "convert" else f"{Path(str(src)).name}, RoPE extended"
    summary = (
        f"A {family_name} checkpoint converted to gated softmax attention (the sigmoid output gate of *Gated "
        "Attention for Large Language Models*)." if command == "convert"
        else "A gated-attention checkpoint with its RoPE changed for a longer context."
    )
    how_to_load = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)\n'
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")\n```\n\n'
        "With `pip install gated-attention`, `import gated_attention` first and drop `trust_remote_code`."
    )
    continue_pretraining = (
        "The gates start where they do no harm and only help once trained. With the gated-attention "
        "repository's example script (`accelerate launch`, DDP or FSDP configs in `examples/configs/`):\n\n"
        "```bash\naccelerate launch --config_file examples/configs/ddp.yaml examples/continued_pretraining.py \\\n"
        "    --model PATH_OR_REPO --output-dir runs/cpt --text-files data/ \\\n"
        "    --seq-len 2048 --batch-size 4 --grad-accum 8 --steps 2000 --lr 2e-5 --gate-lr 1e-3\n```\n\n"
        "Known trap (official Gated Attention repo, issue #10): converted gates may barely move in continued "
        "pretraining. Give the gate parameters (`*.self_attn.attn_gate.*`) their own, larger learning rate "
        "(`--gate-lr` above) and watch the mean gate score the script logs; it starts at exactly 0.5 "
        "with the exact init. With PEFT, put `attn_gate` in `modules_to_save` (see `examples/lora_finetune.py`)."
    )
    write_model_card(
        stage,
        "converted_model",
        title=title,
        summary=summary,
        tag="converted" if command == "convert" else "rope-extended",
        options_rows=options_rows(options),
        what_changed="\n".join(changed),
        how_to_load=how_to_load,
        continue_pretraining=continue_pretraining,
        command=f"gated-attention {command}",
        version=__version__,
        **base_model_fields(str(src)),
    )
