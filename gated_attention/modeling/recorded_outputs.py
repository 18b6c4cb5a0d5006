"""What a transformers model declares in `_can_record_outputs`, read once for the whole package.

Every `PreTrainedModel` class of transformers names the module class whose output is each decoder layer's hidden
states ("hidden_states") and the one whose output holds attention weights ("attentions"): the declaration behind
`output_hidden_states` and `output_attentions`. The analysis reads a model's layers and attention modules from it
(`analysis/layout.py`); the declared gate finds its attention modules in it (`attention_sites`).

- A declared value is a class, a class name, an `OutputRecorder`, or a list of them: `Spec`s here (`specs`).
  A spec matches a module as transformers' own recorder matches it: a class by `isinstance`, a name as the end of
  the module's path, and an `OutputRecorder`'s `layer_name` as a part of that path (an encoder-decoder's decoder
  layer names its self-attention `self_attn`, which leaves its cross-attention of the same class out).
- A composite model declares per submodel: `declaration` merges the declarations of the model and of every
  `PreTrainedModel` inside it. The analysis completes each submodel's (`own_declaration`) by its records first
  (classes that predate the declaration, fla's models) and merges them itself.
- `NOT_SOFTMAX`: classes declared under "attentions" whose forward computes no softmax attention (MiniMax's
  lightning attention is linear), so neither a softmax map to read nor a place for the gate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

# Classes declared under "attentions" whose forward is no softmax attention, with what it is instead.
NOT_SOFTMAX = {"MiniMaxLightningAttention": "linear (lightning) attention"}


@dataclass(frozen=True)
class Spec:
    """One entry of a `_can_record_outputs` value: a class, or the end of a module's path, optionally under a
    named submodule."""

    target_class: type | None = None
    class_name: str | None = None
    layer_name: str | None = None
    # The config field that counts these modules, where it is not num_hidden_layers (Longcat-Flash: num_layers).
    num_layers_key: str | None = None
    # Which item of the module's output tuple is recorded (`OutputRecorder.index`); None: transformers' default for
    # a plain class, 0 for hidden states and 1 for anything else (attention weights).
    index: int | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module at path `name` (under whichever root the caller walks) is one this spec declares."""
        hit = (self.target_class is not None and isinstance(module, self.target_class)) or (
            self.class_name is not None and name.endswith(self.class_name)
        )
        if hit and self.layer_name is not None:
            return f".{self.layer_name.strip('.')}." in f".{name}."
        return hit


def specs(value) -> list[Spec]:
    """A `_can_record_outputs` value (a class, a class name, an `OutputRecorder`, or a list of them) as `Spec`s."""
    out = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, type):
            out.append(Spec(target_class=item))
        elif isinstance(item, str):
            out.append(Spec(class_name=item))
        else:  # transformers' OutputRecorder
            key = getattr(item, "num_hidden_layers_key", None)
            out.append(Spec(getattr(item, "target_class", None), getattr(item, "class_name", None),
                            getattr(item, "layer_name", None), None if key == "num_hidden_layers" else key,
                            getattr(item, "index", None)))
    return out


def pretrained_models(model: nn.Module) -> Iterator[nn.Module]:
    """`model` and every `PreTrainedModel` inside it, outer first (a composite model declares per submodel)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            yield module


def own_declaration(model: nn.Module) -> dict[str, list[Spec]]:
    """What `model`'s own class declares, key -> specs (empty where it declares nothing)."""
    return {key: specs(value) for key, value in (getattr(model, "_can_record_outputs", None) or {}).items()}


def declaration(model: nn.Module) -> dict[str, list[Spec]]:
    """Key -> specs of `model`: the declarations of every `PreTrainedModel` in it, merged, outer first; a key no
    submodel declares is absent."""
    merged: dict[str, list[Spec]] = {}
    for sub in pretrained_models(model):
        for key, found in own_declaration(sub).items():
            merged.setdefault(key, []).extend(found)
    return merged


def is_softmax(module: nn.Module) -> bool:
    """Whether a declared attention module computes softmax attention (its class is not in `NOT_SOFTMAX`)."""
    return type(module).__name__ not in NOT_SOFTMAX


def declared_by(found: list[Spec]) -> Callable[[str, nn.Module], bool]:
    """Whether the module at a path is one of `found`'s (a key's specs, merged)."""
    return lambda name, module: any(spec.matches(name, module) for spec in found)


def softmax_attention(attentions: list[Spec]) -> Callable[[str, nn.Module], bool]:
    """Whether the module at a path is a declared attention (one of `attentions`) that computes softmax attention."""
    declared = declared_by(attentions)
    return lambda name, module: is_softmax(module) and declared(name, module)


def declared_modules(root: nn.Module, matches: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The modules under `root` that `matches(name, module)` accepts, each once (a module several layers share, as
    Zamba's attention block, under its first name), with its name under `root`, in the order `root` holds them."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if id(module) not in found and matches(name, module):
            found[id(module)] = (name, module)
    return list(found.values())
