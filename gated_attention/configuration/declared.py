"""Configs of transformers' own models with the gate added by declaration (`model_type` "gated_declared").

A source the package has no model family for (Gemma 2, OLMo 2, Granite, ...) keeps its own transformers
config class: `declared_config_class(Gemma2Config)` is `GatedGemma2Config`, a subclass that adds the gate
spec `attn_gate` (`gate_spec.py`; only the position "sdpa", the input of each attention's output
projection, which is where a gate can be added to a forward the package does not own) and nothing else.
In memory its `model_type` is the source's ("gemma2"), so transformers treats it as it treats the
source: its weight conversions, its caches, its tokenizer.

On disk the config is the source's, plus `attn_gate` and `source_model_type`, under `model_type`
"gated_declared": a model type transformers does not own, so that `import gated_attention` can register
it (`GatedDeclaredConfig`, which builds the source's class back from `source_model_type`), and so that
transformers never loads the folder as a plain source model, whose output projections are doubled
(`convert --init exact`), without its gates. The remote-code route (`trust_remote_code=True`, the
package not installed) reads the same file through the same class, copied into the checkpoint.

The models themselves are `modeling/declared.py`'s. A made class is announced to the functions given to
`on_declared_config_class` (`gated_attention.register_auto_classes` registers its models with the Auto
classes there), and it can be found by name in this module (pickling, transformers' `auto_map`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# First: it checks the installed transformers, which the imports below depend on.
from ..compat import TRANSFORMERS_FLOOR  # noqa: F401  # isort: skip

from transformers import PreTrainedConfig

from .gate_spec import DEFAULT_GATE_SPEC, gate_enabled, normalize_gate_spec

DECLARED_MODEL_TYPE = "gated_declared"
SOURCE_KEY = "source_model_type"  # the source's model type, written beside DECLARED_MODEL_TYPE
CLASS_PREFIX = "Gated"  # GatedGemma2Config, GatedGemma2ForCausalLM


def transformers_class(cls: type) -> type | None:
    """The first of transformers' own classes in `cls`'s MRO: the class a declared class (or config class) was made
    from, or `cls` itself; None for a class with none (fla's, a remote-code copy's)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("transformers.")), None)


def text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The config of a model's text decoder: a composite model's text config, else `config` itself (a config
    without `get_text_config`, as some remote-code ones, included)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def declared_gate_spec(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The normalised spec of a declared model's gate: any spec `normalize_gate_spec` allows at the position
    "sdpa" (G1), or none. Raises `ValueError` naming the key otherwise."""
    spec = normalize_gate_spec(spec)
    if gate_enabled(spec) and spec["position"] != "sdpa":
        raise ValueError(
            f"attn_gate.position={spec['position']!r} is not allowed for a model gated by declaration; allowed values: "
            "'sdpa' (the input of each attention's output projection), null (the model's own class, without "
            "attention code of this package, is gated only there)"
        )
    return spec


class DeclaredGateConfig:
    """What a declared config adds to its source's class: the gate spec, and its model type on disk.

    Listed before the source's class among a made class's bases (`declared_config_class`).
    """

    def __post_init__(self, **kwargs):
        # On disk, model_type is DECLARED_MODEL_TYPE and the source's is SOURCE_KEY; in memory both are the class's.
        kwargs.pop("model_type", None)
        kwargs.pop(SOURCE_KEY, None)
        spec = kwargs.pop("attn_gate", DEFAULT_GATE_SPEC)
        if kwargs.pop("attention_sinks", False) is not False:  # this package's field, which only its own attention reads
            raise ValueError(
                "attention_sinks=true is not allowed for a model gated by declaration: learned sinks need this "
                "package's own attention, and the source's class runs its own; allowed values: false (or leave it out)"
            )
        super().__post_init__(**kwargs)
        self.attn_gate = declared_gate_spec(spec)

    @property
    def source_model_type(self) -> str:
        return type(self).model_type

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["model_type"], out[SOURCE_KEY] = DECLARED_MODEL_TYPE, type(self).model_type
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        # The gate is written even where it is the default one: what a reader of config.json sees is what loads.
        return {**super().to_diff_dict(), "model_type": DECLARED_MODEL_TYPE, SOURCE_KEY: type(self).model_type,
                "attn_gate": self.attn_gate}

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        # `GatedGemma2Config.from_pretrained(DST)` reads DST's config.json as Gemma2Config reads the source's: its
        # check that the file's model type is the class's (and the search of sub-configs for it) sees the source's.
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        if config_dict.get("model_type") == DECLARED_MODEL_TYPE:
            config_dict = {**config_dict, "model_type": config_dict.get(SOURCE_KEY, cls.model_type)}
        return config_dict, kwargs


_MADE: dict[type, type] = {}  # source config class -> its declared class
_LISTENERS: list[Callable[[type], None]] = []


def declared_config_class(source: type[PreTrainedConfig]) -> type[PreTrainedConfig]:
    """`Gated<Source>`: `source` (a transformers config class) with the gate spec, made once per process."""
    if issubclass(source, DeclaredGateConfig):
        return source
    made = _MADE.get(source)
    if made is None:
        name = CLASS_PREFIX + source.__name__
        made = type(name, (DeclaredGateConfig, source), {"__module__": __name__, "__qualname__": name})
        _MADE[source] = made
        for listener in list(_LISTENERS):
            listener(made)
    return made


def on_declared_config_class(listener: Callable[[type], None]) -> None:
    """Call `listener(cls)` for every declared config class, those made already and those to come (once each)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)
        for made in list(_MADE.values()):
            listener(made)


def source_config_class(model_type: Any) -> type[PreTrainedConfig]:
    """transformers' own config class of a source model type (never another package's that registered the same
    type: importing fla registers its own `bitnet`); `ValueError` in one line for one it does not ship."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = CONFIG_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    if name is None or not isinstance(getattr(transformers, name, None), type):
        raise ValueError(
            f"a {DECLARED_MODEL_TYPE} config needs {SOURCE_KEY}, the model type of a transformers model; got "
            f"{model_type!r}, which this transformers does not ship"
        )
    return getattr(transformers, name)


def declared_config(source: PreTrainedConfig, attn_gate: dict[str, Any] | None = DEFAULT_GATE_SPEC) -> PreTrainedConfig:
    """The declared config of a transformers config: every field of `source`, plus `attn_gate`."""
    fields = {k: v for k, v in source.to_dict().items() if k not in ("transformers_version", "architectures")}
    return declared_config_class(type(source)).from_dict({**fields, "attn_gate": attn_gate})


class GatedDeclaredConfig(PreTrainedConfig):
    """The config class of `model_type` "gated_declared" (the Auto classes' and a checkpoint's `auto_map`'s):
    it reads a config.json as its source's declared class, `declared_config_class(<source's class>)`, and
    returns an instance of that."""

    model_type = DECLARED_MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        source = source_config_class(config_dict.get(SOURCE_KEY))
        return declared_config_class(source).from_dict(dict(config_dict), **kwargs)


def __getattr__(name: str):
    """`Gated<Source>` by name: a pickled config, or an `auto_map` entry, names the class made here."""
    import transformers

    source = getattr(transformers, name[len(CLASS_PREFIX):], None) if name.startswith(CLASS_PREFIX) else None
    if isinstance(source, type) and issubclass(source, PreTrainedConfig):
        return declared_config_class(source)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
