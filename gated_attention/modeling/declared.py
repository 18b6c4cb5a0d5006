"""transformers' own models with the gate added by declaration: `Gated<Source>` classes.

`declared_model_class(Gemma2ForCausalLM)` is `GatedGemma2ForCausalLM`: the source's class, whose code
runs unchanged, with one addition at construction (`post_init`): every softmax-attention module that
`attention_sites` finds gets a gate `attn_gate` (this package's `AttentionGate`, or
`ConstantAttentionGate` for an input-independent spec) and two hooks (`OutputGate`):

    attention(x, ...):   logits = attn_gate(x)                # forward pre-hook on the attention
        ...
        o_proj(y):        o_proj(y * act(logits))             # forward pre-hook on its output projection

so the gate reads the attention's input and multiplies the heads' output before the output projection,
the paper's G1, wherever the model's code puts it. Nothing of the source's forward is copied: a release
that changes it changes the gated model the same way. The gate's logits are kept from the first hook
to the second; an attention that returns without calling its output projection, or a projection called
outside its attention, raises instead of running ungated.

The output projection's hook follows the module at its name: PEFT (LoRA on `o_proj`) and vLLM's
transformers backend put their own module there after the model is built (`setattr`), and the gate then
multiplies that module's input (both branches of a LoRA layer, as in this package's own attention), its
hook moved from the one it replaced as the module is put there (`FollowsOutputProjection`, a subclass of
the attention's own class that the attention module is given: a hook registered inside a forward would
fail under torch.compile, which vLLM runs by default).

The tensor-parallel plan gains a rule for each gate whose output projection the source's plan names
(`configuration/tensor_parallel.gate_rule`: "colwise" for a per-head gate, so each rank scores the heads
its `o_proj` shard reads), in the base model's `base_model_tp_plan` (in memory: transformers does not
write it to config.json, and vLLM reads the built model's) and in every submodel's plan made before the
gates.

To transformers a declared class is the source's code (`is_custom_code`): its weight renamings and its
buffers' initialisation at load are the source's. A class that serves several model types (EXAONE's is
`LlamaForCausalLM`) has a declared class per config class, `Gated<Source>__<Config>`.

`register_declared_models` registers a declared config class's models with AutoModel and
AutoModelForCausalLM (`gated_attention.register_auto_classes` calls it for each class made); a
checkpoint's remote-code copy of this file finds the classes by name (`auto_map`) instead.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..configuration.declared import (CLASS_PREFIX, GatedDeclaredConfig, declared_config_class, declared_gate_spec,
                                      transformers_class)
from ..configuration.gate_spec import GATE_NAME, check_gate_shape, gate_enabled
from ..configuration.tensor_parallel import gate_plan_key, gate_rule
from .attention import GateScores, build_gate, gate_logits
from .attention_sites import AttentionSite, AttentionSiteError, attention_sites
from .recorded_outputs import transformers_classes
from .tensor_parallel import check_distributed_config  # noqa: F401  # importing registers the plan's own styles

try:
    from gated_attention.hub.remote_code import auto_map, write_bundle
except ImportError:  # running from a remote-code copy, where transformers copies the files itself
    write_bundle = None


class OutputGate:
    """One attention's gate: its logits from the attention's input, applied to its output projection's input.

    `logits`: `[B, T, out_features]` from the attention's pre-hook until its output projection reads them
    (`GateScores.combine` activates them, as in this package's own attention).
    """

    def __init__(self, site: AttentionSite, spec: dict):
        self.site = site
        check_gate_shape(spec, site.in_features, site.heads, site.heads, site.head_dim)  # rank, input_channels
        self.gate_scores = GateScores(spec, site.in_features, site.heads, site.heads, site.head_dim)
        self.input_channels = spec["input_channels"]  # None: all of the attention's input
        attention = site.attention
        attention.add_module(GATE_NAME, build_gate(spec, self.gate_scores, site.in_features))
        self.logits: torch.Tensor | None = None
        self.projection: nn.Module | None = None
        self._projection_hook = None
        self._follow(getattr(attention, site.output))
        attention.register_forward_pre_hook(self._score, with_kwargs=True)
        attention.register_forward_hook(self._check_applied)
        # From now on a module put at the output projection's name (PEFT's LoRA layer, vLLM's parallel linear) gets
        # the hook as it is put there, outside any forward (a hook registered while torch.compile traces one fails).
        attention.__class__ = _following(type(attention))
        object.__setattr__(attention, "_output_gate", self)

    def _follow(self, projection: nn.Module) -> None:
        """Hook `projection`, the module now at the output projection's name, and unhook the one it replaced."""
        if self._projection_hook is not None:
            self._projection_hook.remove()
        self.projection = projection
        self._projection_hook = projection.register_forward_pre_hook(self._apply, with_kwargs=True)

    def _score(self, attention: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs[self.site.input_name] if self.site.input_name in kwargs else args[0]  # [B, T, in_features]
        self.logits = gate_logits(getattr(attention, GATE_NAME), x, self.input_channels)  # [B, T, out_features]

    def _apply(self, projection: nn.Module, args: tuple, kwargs: dict):
        if self.logits is None:
            raise RuntimeError(f"{self.site.path}.{self.site.output} ran outside its attention (or twice in one call of "
                               "it): its gate has nothing to apply")  # fmt: skip
        y, logits, self.logits = args[0], self.logits, None  # y: [..., HQ * D]
        y = self.gate_scores.combine(y.view(*y.shape[:-1], -1, self.site.head_dim), logits)  # [..., HQ, D]
        return (y.view(*y.shape[:-2], -1), *args[1:]), kwargs

    def _check_applied(self, attention: nn.Module, args: tuple, output) -> None:
        if self.logits is not None:
            self.logits = None
            raise RuntimeError(f"{self.site.path} returned without calling its output projection {self.site.output}: "
                               "its gate was not applied")  # fmt: skip


class FollowsOutputProjection:
    """What a gated attention module's class adds to its source's: a module assigned to the output projection's
    name is hooked by the gate (`OutputGate._follow`). The attention's class is swapped for this subclass of it
    (`_following`), which keeps its name, its methods and `isinstance` with the source's class."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        gate = self.__dict__.get("_output_gate")
        if gate is not None and name == gate.site.output:
            gate._follow(value)


_FOLLOWING: dict[type, type] = {}


def _following(cls: type) -> type:
    made = _FOLLOWING.get(cls)
    if made is None:
        made = _FOLLOWING[cls] = type(cls.__name__, (FollowsOutputProjection, cls), {"__qualname__": cls.__qualname__})
    return made


def add_gates(model: nn.Module, spec: dict) -> list[OutputGate]:
    """Add a gate of `spec` to every attention `attention_sites(model)` finds, and its rule to the tensor-parallel
    plans (see the module docstring). `AttentionSiteError` (one line) where the sites cannot be found."""
    spec = declared_gate_spec(spec)
    if not gate_enabled(spec):
        return []
    if hasattr(model, "init_parallel_plans"):
        model.init_parallel_plans()  # the plan the sites are read from; post_init makes it again, with the gates
    sites = attention_sites(model)
    if spec["granularity"] != "headwise" and (latent := next((s for s in sites if s.latent), None)) is not None:
        raise AttentionSiteError(
            f"{type(latent.attention).__name__} is latent attention (MLA: {latent.latent}), which takes a headwise gate "
            "only: absorbed inference folds each head's value up-projection into the output projection, which a "
            "per-head score commutes with and an elementwise gate does not; use --gate headwise"
        )
    gates = [OutputGate(site, spec) for site in sites]
    # A low-rank gate shards its `up` as the full gate's projection; its `down` stays whole (as the families').
    _add_plan_rules(model, sites, gate_plan_key(spec), gate_rule(spec))
    return gates


def _add_plan_rules(model: nn.Module, sites: list[AttentionSite], module: str, style: str) -> None:
    from transformers import PreTrainedModel

    rules = {f"{site.plan_key.rsplit('.', 1)[0]}.{module}": style for site in sites if site.plan_key is not None}
    if not rules:
        return
    for path, sub in model.named_modules():
        if not isinstance(sub, PreTrainedModel):
            continue
        own = {key.removeprefix(f"{path}."): s for key, s in rules.items() if not path or key.startswith(f"{path}.")}
        if path and own and isinstance(getattr(sub, "_tp_plan", None), dict):
            sub._tp_plan.update(own)  # made by its own post_init, before the gates
        if own and sub.base_model is sub and getattr(sub.config, "base_model_tp_plan", None):
            sub.config.base_model_tp_plan = {**sub.config.base_model_tp_plan, **own}  # an instance copy


class DeclaredGatesMixin:
    """What a declared model class adds to its source's class: the gates, and a save with the remote code.

    Listed before the source's class among a made class's bases (`declared_model_class`).
    """

    def post_init(self):
        self.output_gates = add_gates(self, self.config.attn_gate)
        super().post_init()

    @classmethod
    def is_custom_code(cls) -> bool:
        """What transformers answers for the source's class (False for its own classes): the source's code is what
        runs. transformers treats a class outside its modules as custom code: it would skip the model type's weight
        renamings (EXAONE's files are `transformer.h.*`, a composite model's `language_model.model.*`) and leave
        non-persistent buffers that the source's `_init_weights` makes while loading as they were (Falcon-H1's
        `mup_vector`: garbage, then NaN)."""
        return _source_class(cls).is_custom_code()

    # transformers decides whether a model can switch its attention or experts implementation by reading the source
    # of the model class's module (its decorators); the source's module is the one that says it, not this one (a
    # remote copy would otherwise run MoE experts one by one where the package runs them grouped).
    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return _source_class(cls)._can_set_attn_implementation()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return _source_class(cls)._can_set_experts_implementation()

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        # Saved from the installed package, the checkpoint gets flat copies of this file and the config's and an
        # auto_map; a model loaded as remote code has `_auto_class`, and transformers copies its own files.
        # `push_to_hub=True` (with repo_id, private, token, commit_message, ...) is transformers' own push.
        bundle = write_bundle is not None and self._auto_class is None
        self._remote_code_files = write_declared_remote_code(save_directory, self.config) if bundle else []
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del self._remote_code_files

    def _get_files_timestamps(self, working_dir: str | os.PathLike) -> dict[str, float]:
        # transformers' push uploads the files its save_pretrained writes after listing the folder here; the
        # remote-code files were written just before, so they are left out of the list to be uploaded too.
        written = getattr(self, "_remote_code_files", ())
        return {f: t for f, t in super()._get_files_timestamps(working_dir).items() if f not in written}


def _source_class(cls: type) -> type:
    """The transformers class a declared class was made from."""
    return transformers_class(cls)


_MADE: dict[tuple[type, type], type] = {}
CONFIG_SEPARATOR = "__"  # GatedLlamaForCausalLM__ExaoneConfig: a class that serves another type's config


def declared_model_class(source: type, config_class: type | None = None) -> type:
    """`Gated<Source>`: the transformers model class `source` with the gates, for the declared config of
    `config_class` (default: the source's own; transformers serves some model types with another type's class,
    EXAONE's with `LlamaForCausalLM`: then `Gated<Source>__<Config>`), made once per process."""
    if issubclass(source, DeclaredGatesMixin):
        return source
    config_class = config_class or source.config_class
    made = _MADE.get((source, config_class))
    if made is None:
        name = CLASS_PREFIX + source.__name__
        if config_class is not source.config_class:
            name += CONFIG_SEPARATOR + config_class.__name__
        made = type(name, (DeclaredGatesMixin, source), {
            "__module__": __name__, "__qualname__": name, "config_class": declared_config_class(config_class),
        })  # fmt: skip
        _MADE[(source, config_class)] = made
        _share_conversions(source, made)
    return made


def _share_conversions(source: type, made: type) -> None:
    """transformers looks a model's weight renamings up by its class name first, then by its model type: a mapping of
    the source's class name (none of its own classes has one today) is registered under the declared class's."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

    if mapping := get_checkpoint_conversion_mapping(source.__name__):
        register_checkpoint_conversion_mapping(made.__name__, mapping, overwrite=True)


def declared_auto_map(config) -> dict[str, str]:
    """The `auto_map` of a declared config's checkpoint: the flat copies of this file's and the config's module."""
    return auto_map(GatedDeclaredConfig.__module__, GatedDeclaredConfig.__name__, __name__,
                    **{auto: made.__name__ for auto, made in declared_models(type(config)).items()})


def declared_models(config_class: type) -> dict[str, type]:
    """The declared model classes of a declared config class, as the Auto classes name them for its model type."""
    source_config = transformers_class(config_class)
    return {auto: declared_model_class(source, source_config)
            for auto, source in transformers_classes(config_class.model_type).items()}


def write_declared_remote_code(save_directory: str | os.PathLike, config) -> list[str]:
    """Write the remote-code bundle of a declared model into `save_directory` (flat copies of this file, the
    config's and what they import) and set `config.auto_map` and `config.architectures`, without building the
    model. Returns the names of the files written. Only from the installed package."""
    files = write_bundle(save_directory, __name__, GatedDeclaredConfig.__module__)
    config.auto_map = declared_auto_map(config)
    if "AutoModelForCausalLM" in config.auto_map:
        config.architectures = [config.auto_map["AutoModelForCausalLM"].split(".")[-1]]
    return files


def register_declared_models(config_class: type) -> None:
    """Register the declared models of `config_class` (a declared config class) with the Auto classes."""
    from transformers import AutoModel, AutoModelForCausalLM

    autos = {"AutoModel": AutoModel, "AutoModelForCausalLM": AutoModelForCausalLM}
    for auto, made in declared_models(config_class).items():
        autos[auto].register(config_class, made, exist_ok=True)


def __getattr__(name: str):
    """`Gated<Source>` (or `Gated<Source>__<Config>`) by name: a checkpoint's `auto_map` (and a pickled model) names
    the classes made here."""
    import transformers

    if name.startswith(CLASS_PREFIX):
        model, _, config = name[len(CLASS_PREFIX):].partition(CONFIG_SEPARATOR)
        source, config_class = getattr(transformers, model, None), getattr(transformers, config, None) if config else None
        if (isinstance(source, type) and issubclass(source, transformers.PreTrainedModel)
                and (not config or isinstance(config_class, type) and issubclass(config_class, transformers.PreTrainedConfig))):
            return declared_model_class(source, config_class)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
