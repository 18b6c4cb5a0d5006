"""Sources no family maps onto this package's classes: any causal LM transformers ships, gated by declaration.

The source keeps its own transformers classes (`modeling/declared.py`): DST is SRC's tensors, each
attention's output projection doubled and a gate `attn_gate` beside it (`plan.AddGate`, one rule per
attention module `attention_sites` finds in the model built on the meta device), under SRC's config
plus the gate (`configuration/declared.py`). Where SRC's tensor names are the model's own, every name
and shape is checked against the model's; where transformers renames or fuses them while loading
(its `conversion_mapping` for the model type: MoE experts saved per expert), SRC's names are kept as
they are, and the verification loads DST strictly: every weight from the file, every tensor used.

The verification runs SRC in the source's transformers class and DST in its declared class (not
through the Auto classes, which a process that imported fla would point at fla's model for some
types), both with SDPA where the class supports it and eager attention where it does not.

The model types neither `convert` nor `analyze` reads (`modeling/recorded_outputs.REFUSED`: inputs that are no text
tokens, attention that is no softmax map of them) are refused in one line, with the reason, before anything is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..cli_common import first_line
from ..configuration.declared import DECLARED_MODEL_TYPE, declared_config, text_config
from .errors import ConversionError
from .families import FAMILIES
from .plan import IGNORED_SOURCE_TENSORS, AddGate
from .quantized import source_loader
from .rope import RopeChange, apply_rope_change
from .shapes import expected_shapes
from .sources import SourceCheckpoint
from .verify import verify_against_source

if TYPE_CHECKING:  # the modeling code is imported where a source is gated by declaration, not for a family's
    from ..modeling.attention_sites import AttentionSite


def declared_model_type(config_dict: dict) -> str | None:
    """SRC's model type if it is a causal LM transformers ships (and no family of ours reads it), else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from ..modeling.recorded_outputs import REFUSED, transformers_classes  # here: a family record needs no model code

    model_type = config_dict.get("model_type")
    if model_type == DECLARED_MODEL_TYPE:
        raise ConversionError(f"SRC is already a gated model ({DECLARED_MODEL_TYPE}, gated by declaration: "
                              f"{config_dict.get('source_model_type')}); use `gated-attention extend` to change its RoPE")
    if any(model_type in family.model_types for family in FAMILIES):
        return None
    if model_type in REFUSED:
        raise ConversionError(f"SRC's {model_type} model cannot be converted: {REFUSED[model_type]}")
    if model_type in CONFIG_MAPPING_NAMES and "AutoModelForCausalLM" in transformers_classes(model_type):
        return model_type
    return None


@dataclass
class DeclaredTarget:
    """What a conversion by declaration writes and checks."""

    config: object  # the declared config: SRC's, plus the gate
    source_config: object  # SRC's, as its transformers class reads it
    source_class: type  # transformers' causal LM class
    model_class: type  # its declared class
    sites: list[AttentionSite]
    expected: dict[str, tuple[int, ...]]  # every DST tensor's name and shape
    renamed: bool  # transformers fuses or splits SRC's tensors while loading: DST keeps SRC's, loaded strictly
    outputs: dict[str, str]  # each site's path -> its output projection's module as SRC's files name it
    gates: dict[str, str]  # each site's path -> its gate module as DST's files name it (beside the projection)
    buffers: set[str] = field(default_factory=set)  # SRC's tensors that are the model's buffers, not its weights
    attention: str = "sdpa"  # what both sides of the verification run: SDPA where every submodel has it, else eager

    def finite(self, outputs) -> list[str]:
        """The SRC tensors to check for inf and NaN: the outputs' sources that are weights. A buffer may hold inf by
        design (Gemma 4's clipped linears keep `input_max = inf` where they clip nothing)."""
        return [name for o in outputs for name in o.sources if name not in self.buffers]

    @property
    def rules(self) -> tuple[AddGate, ...]:
        """A gate per attention; a projection several attentions share (tied weights, stored once) doubled once."""
        doubled, rules = set(), []
        for site in self.sites:
            output = f"{self.outputs[site.path]}.weight"
            rules.append(AddGate(output, self.gates[site.path], double=output not in doubled))
            doubled.add(output)
        return tuple(rules)


    def describe(self) -> str:
        first = self.sites[0]
        n = len(self.sites)
        return f"{n} attention module{'s' * (n != 1)} ({type(first.attention).__name__}, output projection {first.output})"


def declared_target(folder: Path, ckpt: SourceCheckpoint, model_type: str, gate_spec: dict) -> DeclaredTarget:
    """SRC's declared config and model, the gates' places and every DST tensor's shape; refused in one line where
    SRC's attention cannot be gated."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from ..configuration.declared import source_config_class
    from ..modeling.attention_sites import AttentionSiteError
    from ..modeling.declared import GATE_NAME, declared_model_class
    from ..modeling.recorded_outputs import transformers_classes

    source_class = transformers_classes(model_type)["AutoModelForCausalLM"]
    try:
        source_config = source_config_class(model_type).from_pretrained(folder)
        config = declared_config(source_config, gate_spec)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConversionError(f"SRC config.json does not describe a valid {model_type} model: {first_line(e)}") from None
    model_class = declared_model_class(source_class, source_config_class(model_type))
    try:
        with torch.device("meta"):
            model = model_class(copy.deepcopy(config))
    except AttentionSiteError as e:  # a source gated already is told so, not to try another --gate (MLA's headwise)
        refuse_gated_source(f"{model_type} model ({source_class.__name__})", source_class, source_config)
        raise ConversionError(f"SRC's {model_type} model ({source_class.__name__}) cannot be gated: {e}") from None
    except ValueError as e:  # a gate shape the attention's widths do not allow
        raise ConversionError(f"{first_line(e)} (--gate-rank, --gate-input-channels)") from None
    sites = [gate.site for gate in model.output_gates]
    if not sites:
        raise ConversionError(f"SRC's {model_type} model ({source_class.__name__}) has no attention module to gate")
    refuse_second_gate(f"{model_type} model ({source_class.__name__})", model, [site.attention for site in sites])
    # Tied copies (an lm_head, BioGPT's output_projection) SRC's files leave out: the model ties them while loading.
    tied = {name for name in getattr(model, "all_tied_weights_keys", None) or {} if name not in ckpt.tensors}
    shapes = {name: shape for name, shape in expected_shapes(model).items() if name not in tied}
    kept = {n for n in ckpt.tensors if not (IGNORED_SOURCE_TENSORS.search(n) or n in tied)}
    names = _ModelNames((model_class.__name__, model_type), kept)
    outputs, gate_modules, disk_gates = {}, {}, {}
    for site in sites:
        name = names.stored(f"{site.path}.{site.output}.weight")
        if name is None:
            raise ConversionError(
                f"SRC has no tensor for {site.path}.{site.output}.weight, the output projection of "
                f"{type(site.attention).__name__} (its checkpoint lacks it, or names it otherwise)"
            )
        outputs[site.path] = name.removesuffix(".weight")
        # The gate as the model names it, or beside its projection as SRC's files name it: whichever loads as the
        # model's (transformers renames the second with the projection; a renaming may not leave the first alone).
        beside = outputs[site.path].removesuffix(site.output) + GATE_NAME
        gate_modules[site.path] = next((m for m in (f"{site.path}.{GATE_NAME}", beside)
                                        if names.in_memory(f"{m}.weight") == f"{site.path}.{GATE_NAME}.weight"), beside)
        for name, shape in shapes.items():
            if name.startswith(f"{site.path}.{GATE_NAME}."):
                disk_gates[gate_modules[site.path] + name.removeprefix(f"{site.path}.{GATE_NAME}")] = shape
    gates = {name for name in shapes if f".{GATE_NAME}." in name}
    renamings = any(get_checkpoint_conversion_mapping(key) for key in (source_class.__name__, model_type))
    if kept == set(shapes) - gates or not renamings:
        renamed = False
        expected = shapes
    else:  # transformers renames, fuses or splits SRC's tensors while loading (EXAONE's `transformer.h.*`, MoE experts
        # saved per expert, a composite model's `language_model.model.*`): they are kept as SRC has them
        renamed = True
        expected = {name: tuple(info.shape) for name, info in ckpt.tensors.items() if name in kept} | disk_gates
    buffer_names = {name for name, _ in model.named_buffers()}
    buffers = {name for name in kept if names.in_memory(name) in buffer_names}
    return DeclaredTarget(config, source_config, source_class, model_class, sites, expected, renamed, outputs, gate_modules,
                          buffers, _attention(model))


# config.json flags by which a model says that it gates its attention output (vLLM's Qwen3-Next and Qwen3.5 read
# `attn_output_gate`; Lfm3's `use_attention_gate`), in the config or its text config.
OWN_GATE_FLAGS = ("attn_output_gate", "use_attention_gate")


def _already_gated(source: str, gate: str, read: bool = True) -> ConversionError:
    """`read`: whether `analyze` reads the gate's scores (an `UNREAD_OUTPUT_GATES` gate it does not)."""
    analyze = ("`gated-attention analyze` reads that gate's scores" if read
               else "`gated-attention analyze` reads the model, though not that gate's scores")
    return ConversionError(f"SRC's {source} gates its attention output already ({gate}): {analyze}, and `export` "
                           "and serving engines take the model as it is; convert adds no second gate")  # fmt: skip


def refuse_gated_config(config_dict: dict) -> None:
    """Refuse, in one line, a source whose config.json (or its text config) sets an `OWN_GATE_FLAGS` flag."""
    text = config_dict.get("text_config")
    for part in (config_dict, text if isinstance(text, dict) else {}):
        for flag in OWN_GATE_FLAGS:
            if part.get(flag) is True:
                raise _already_gated(f"{config_dict.get('model_type')} model", f"config.json sets {flag}: true")


def refuse_second_gate(source: str, model, attentions) -> None:
    """Refuse, in one line, a source one of whose `attentions` has an output gate of its own, a module `analyze` reads
    as the attention's gate site (`modeling.gate_sites.source_gate`), or a gate it reads no scores of
    (`gate_sites.UNREAD_OUTPUT_GATES`). `source` names SRC's model type and class."""
    from ..modeling.gate_sites import source_gate, unread_gate

    text = text_config(model.config)
    for attention in attentions:
        gate = source_gate(text, attention)
        if gate is not None and gate.kind in ("q_proj", "projection"):  # learned sinks are no output gate
            raise _already_gated(source, f"{type(attention).__name__}'s {gate.describe()}")
        if (unread := unread_gate(attention)) is not None:
            raise _already_gated(source, f"{type(attention).__name__}'s {unread}", read=False)


def refuse_gated_source(source: str, source_class, source_config) -> None:
    """`refuse_second_gate` on SRC's own model (transformers' class, built on the meta device), for a source whose
    attention takes no gate of the kind asked: its own softmax attention modules, as `analyze` finds them."""
    from ..modeling.recorded_outputs import declaration, declared_modules, softmax_attention

    with torch.device("meta"):
        model = source_class._from_config(copy.deepcopy(source_config))
    is_attention = softmax_attention(declaration(model).get("attentions", []))
    refuse_second_gate(source, model, [attention for _, attention in declared_modules(model, is_attention)])


def _attention(model) -> str:
    """SDPA where every `PreTrainedModel` inside supports it (Gemma 4's audio tower does not), else eager."""
    from transformers import PreTrainedModel

    sdpa = all(getattr(m, "_supports_sdpa", False) for m in model.modules() if isinstance(m, PreTrainedModel))
    return "sdpa" if sdpa else "eager"


class _ModelNames:
    """SRC's tensor names and the model's: transformers' renamings of the model's checkpoints (`WeightRenaming`s of
    its conversion mapping, in order, as loading applies them), and where they do not tell, the tail of the name."""

    def __init__(self, keys: tuple[str, str], stored: set[str]):
        """`keys`: the model's class name and model type, where transformers looks its mapping up, in that order."""
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        mapping = next((m for key in keys if (m := get_checkpoint_conversion_mapping(key))), ())
        self.renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self.by_model_name = {self.in_memory(n): n for n in stored}

    def in_memory(self, name: str) -> str:
        for renaming in self.renamings:
            name, _ = renaming.rename_source_key(name)
        return name

    def stored(self, name: str) -> str | None:
        """The name in SRC's files of the model's tensor `name`, or None."""
        if name in self.by_model_name:
            return self.by_model_name[name]
        # The tail: transformers saves a composite model's text model as `language_model.model.layers.*` and holds it
        # as `model.language_model.layers.*` (a prefix its renamings alone do not give).
        parts = name.split(".")
        for start in range(1, len(parts) - 1):
            tail = "." + ".".join(parts[start:])
            found = [n for m, n in self.by_model_name.items() if m.endswith(tail)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                return None
        return None


def declared_rope_change(target: DeclaredTarget, rope: RopeChange) -> dict:
    """Apply `--rope-theta` / `--yarn-factor` to the declared config's text config, in place; returns what the
    verification's reference loads SRC with (`config=`: SRC's config with the same change), or {} for none."""
    if rope.empty:
        return {}
    text = target.config.get_text_config()
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ConversionError(f"SRC's {target.config.model_type} model has no rotary position encoding "
                              "(rope_parameters): the RoPE options do not apply to it")  # fmt: skip
    text.rope_parameters, text.max_position_embeddings = apply_rope_change(params, text.max_position_embeddings, rope)
    reference = copy.deepcopy(target.source_config)
    source_text = reference.get_text_config()
    source_text.rope_parameters, source_text.max_position_embeddings = text.rope_parameters, text.max_position_embeddings
    return {"config": reference}


class _WithConfig:
    """`cls.from_pretrained` with SRC's config as its transformers class reads it: a class may serve several model
    types (EXAONE's is LlamaForCausalLM), whose own config class `from_pretrained` would not pick by itself."""

    def __init__(self, cls: type, config):
        self.cls, self.config = cls, config

    def from_pretrained(self, folder, **kwargs):
        kwargs.setdefault("config", copy.deepcopy(self.config))
        return self.cls.from_pretrained(folder, **kwargs)


def verify_declared(src_folder: Path, stage: Path, target: DeclaredTarget, dtype, overrides: dict, exact: bool, log,
                    budget, quantization: dict | None = None) -> float:
    """`verify.verify_against_source` with SRC in its transformers class and DST in its declared one (through the Auto
    classes: "gated_declared" is no type fla registers); a model that fails to load or run is one line."""
    try:
        return verify_against_source(
            src_folder, stage, target.config, dtype, overrides, exact, log, budget,
            source_class=source_loader(_WithConfig(target.source_class, target.source_config), quantization),
            attn_implementation=target.attention, strict=target.renamed,
        )  # fmt: skip
    except ConversionError:
        raise
    except (RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise ConversionError(f"verification failed: {target.source_class.__name__} (or its gated class) does not run "
                              f"the fixed prompt: {first_line(e)}") from None


def declared_extend_target(folder: Path, ckpt: SourceCheckpoint) -> DeclaredTarget:
    """A declared checkpoint as `extend` reads it: its config and class, its tensors copied as they are."""
    from ..configuration.declared import GatedDeclaredConfig
    from ..modeling.attention_sites import AttentionSiteError
    from ..modeling.declared import GATE_NAME, declared_models

    try:
        config = GatedDeclaredConfig.from_pretrained(folder)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConversionError(f"SRC config.json does not describe a valid {DECLARED_MODEL_TYPE} model: {first_line(e)}") from None
    model_type = config.source_model_type
    classes = declared_models(type(config))
    if "AutoModelForCausalLM" not in classes:
        raise ConversionError(f"SRC's source model type {model_type!r} has no causal LM in this transformers")
    model_class = classes["AutoModelForCausalLM"]
    try:
        with torch.device("meta"):
            model = model_class(copy.deepcopy(config))
    except AttentionSiteError as e:
        raise ConversionError(f"SRC's gated {model_type} model cannot be built here: {e}") from None
    tied = getattr(config, "tie_word_embeddings", False)
    expected = {name: tuple(info.shape) for name, info in ckpt.tensors.items()
                if not (IGNORED_SOURCE_TENSORS.search(name) or (tied and name == "lm_head.weight"))}  # fmt: skip
    # The reference is SRC itself, in its declared class: the extension changes only the rotary tables.
    sites = [gate.site for gate in model.output_gates]
    return DeclaredTarget(config, copy.deepcopy(config), model_class, model_class, sites, expected, renamed=True,
                          outputs={s.path: f"{s.path}.{s.output}" for s in sites},
                          gates={s.path: f"{s.path}.{GATE_NAME}" for s in sites},
                          buffers={name for name, _ in model.named_buffers()}, attention=_attention(model))
