"""Where a model's decoder layers, softmax-attention modules and attention gates are: the mechanism.

transformers declares, on every model class, which module class yields each decoder layer's hidden
states and which yields attention weights (`_can_record_outputs`, the mechanism behind
`output_hidden_states` and `output_attentions`). The analysis reads that declaration through the
package's one reader (`modeling/recorded_outputs.py`, which the declared gate's `attention_sites` reads
it through too), as transformers' own recorder does; the package's three families declare it the same
way. Where a declaration does not say enough, a record in `model_records` says it, as data, and
`model_layout` picks it here, once: which classes a model without a declaration uses, which models are
refused and why, and the `View` through which its residual states and attention maps are read.

Decoder layers: the entries of the `ModuleList` that holds (or is made of) the declared
hidden-state modules, one per `config.num_hidden_layers` (an encoder-decoder's `decoder_layers`, or
the count the declaration names), in order; of two such lists (a vision tower as deep as the text
model), the text model's. A declared module nested in a wrapper (Zamba2's hybrid layer wraps its
Mamba layer) stands for the wrapper, whose output it gives.

A model that runs some layers several times in one forward (Inkling2-loop's loop layers, HRM's two stacks run
in cycles, Dory's recurrent section) declares the number of calls, not of modules (`total_num_hidden_layers`,
HRM's `num_hidden_layers`), or is named in `model_records.LOOPED`. Its decoder layers are then its layer calls, in the order
the model makes them, read by running it once on two tokens (as transformers' own recorder collects them, one
per call): a module that runs k times is k layers, each named by its module path and pass (1-based, its k-th
call in one forward). `Capture` checks every forward makes the same calls in the same order.

Attention layers (1-based): the decoder layers whose module tree contains a softmax-attention
module. A layer that holds several attention blocks (Longcat-Flash: two, one after the other) has a row
for each (`ModelLayout.attention_rows`). A module shared by several layers (Zamba's one attention block, called by every hybrid
layer) counts for each layer that holds it, and `Capture` attributes each call to the layer that
made it. Falcon-H1 runs attention beside its SSM in every layer: every layer is an attention layer.

Layer types are named as the model names them (`config.layer_types` or `config.layers_block_type`);
a model that names none gets "full_attention" for its attention layers and its layer class's
name for the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..configuration.declared import text_config
from ..modeling.gate_sites import GateSite, gate_site
from ..modeling.recorded_outputs import (REFUSED, Spec, declared_modules, legacy_declaration, own_declaration,
                                         pretrained_models, softmax_attention)
from .model_records import (LAYER_TYPE_FIELDS, LOOPED, PACKAGE_DECLARATIONS, PARALLEL_LAYERS, REQUIRED_FIELDS,
                            UNDECLARED, View, view_of)


class LayoutError(ValueError):
    """A model whose layout cannot be read; the message is one line for the user."""


# ---------------------------------------------------------------- a declaration, completed by the records


def _package_declaration(module: nn.Module) -> dict[str, list[Spec]] | None:
    package = type(module).__module__.split(".")[0]
    record = PACKAGE_DECLARATIONS.get(package)
    if record is None:
        return None
    declared = {}
    for key, (module_name, class_name) in record.items():
        declared[key] = [Spec(target_class=getattr(importlib.import_module(module_name), class_name))]
    return declared


def _no_split_specs(module: nn.Module) -> list[Spec]:
    # accelerate's `_no_split_modules`: the class names of the blocks a model is made of, its decoder layers.
    names = getattr(module, "_no_split_modules", None) or []
    return [Spec(class_name=None, target_class=c) for c in {type(m) for m in module.modules() if type(m).__name__ in names}]


def completed_declaration(model: nn.Module) -> dict[str, list[Spec]]:
    """The hidden-state and attention specs of `model`: its declaration (`recorded_outputs.declaration`, merged over
    submodels), completed by the records (fla's classes, legacy attentions, the decoder layers accelerate names).

    Key "legacy": one entry per submodel read from `recorded_outputs.LEGACY_DECLARATIONS` (its attention returns
    weights on request).
    """
    declared: dict[str, list[Spec]] = {"hidden_states": [], "attentions": [], "legacy": []}
    undeclared_attention = []
    for sub in pretrained_models(model):
        own = own_declaration(sub)
        package = _package_declaration(sub)
        model_type = getattr(getattr(sub, "config", None), "model_type", None)
        if model_type in REFUSED:
            raise LayoutError(f"{type(model).__name__} cannot be analysed: {REFUSED[model_type]}")
        if (required := REQUIRED_FIELDS.get(model_type)) and getattr(sub.config, required[0], None) is None:
            name, choices, use = required
            raise LayoutError(
                f"{type(model).__name__} cannot be analysed: its config sets no `{name}`, which chooses {use}; set it "
                f"in the checkpoint's config.json to the inputs' (one of {list(getattr(sub.config, choices, []))})")
        if not own and (legacy := legacy_declaration(sub)) is not None:
            own = {**legacy, "legacy": legacy["attentions"]}
        if not own.get("hidden_states"):
            own["hidden_states"] = _no_split_specs(sub)
        if "attentions" not in own:
            if package is not None:
                own["attentions"] = package["attentions"]
            elif model_type in UNDECLARED:
                own["attentions"] = []
            else:
                undeclared_attention.append(type(sub).__name__)
        for key in declared:
            declared[key] += own.get(key, [])
    if undeclared_attention and not declared["attentions"]:
        raise LayoutError(
            f"{type(model).__name__} declares no attention modules (transformers' `_can_record_outputs`), so the "
            f"analysis cannot tell which of its layers are attention layers"
        )
    return declared


# ---------------------------------------------------------------- the layout


@dataclass
class ModelLayout:
    """A model as the analysis reads it. Layers are 1-based (HF `layer_idx = layer - 1`)."""

    # The decoder-layer calls of one forward, in order: a module that runs k times in one forward (a loop) is listed
    # k times, each a layer of its own.
    layers: list[nn.Module]
    # Each layer's type as the model names it ("full_attention", "sliding_attention", "linear_attention", ...).
    layer_types: list[str]
    # Each layer that holds softmax attention -> its (first) softmax-attention module.
    attention_modules: dict[int, nn.Module]
    # Each attention layer with an output gate -> where its scores come from.
    gates: dict[int, GateSite]
    # Each layer's module as the model names it ("model.layers.3").
    names: list[str] = field(default_factory=list)
    # Attention blocks after the first in one layer (Longcat-Flash runs `self_attn.0`, then `self_attn.1`): layer ->
    # (name under the layer, module) of each, in the order the layer holds and calls them. Each is a row of its own
    # (`attention_rows`); `attention_modules` and `gates` are the first block's.
    later_blocks: dict[int, list[tuple[str, nn.Module]]] = field(default_factory=dict)
    # The module whose call starts each layer, its input X[layer - 1]: the layer itself but where the layer is no
    # module (`model_records.PARALLEL_LAYERS`: XLM's attention starts it, its last norm ends it).
    entries: list[nn.Module] = field(default_factory=list)
    # Whether a module is a declared softmax attention (`attention_in` asks it again of a layer).
    is_attention: Callable[[str, nn.Module], bool] | None = None
    # The attention returns its weights only when the model is called with `output_attentions=True` (a legacy class).
    weights_on_request: bool = False
    # How residual states and attention weights are read (`model_records.view_of`), chosen when the layout is read.
    view: View = field(default_factory=View)
    # Where an attention module's output holds its weights, as the model declares it (`Spec.index`; 1 by default).
    weights_index: int = 1

    def __post_init__(self) -> None:
        if not self.entries:
            self.entries = list(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_layers(self) -> list[int]:
        """The layers that hold softmax attention, full or sliding-window, in order."""
        return sorted(self.attention_modules)

    @property
    def passes(self) -> list[int]:
        """Each layer's pass: its module's k-th call in one forward (1 but in a loop)."""
        calls: dict[int, int] = {}
        out = []
        for module in self.layers:
            calls[id(module)] = calls.get(id(module), 0) + 1
            out.append(calls[id(module)])
        return out

    def attention_in(self, layer: int) -> nn.Module | None:
        """The softmax-attention module `layer` holds now: a model may replace it as it runs (BigBird swaps its
        block-sparse attention for full attention at inputs too short for blocks)."""
        if not self.is_attention:
            return self.attention_modules.get(layer)
        blocks = declared_modules(self.layers[layer - 1], self.is_attention)
        return blocks[0][1] if blocks else None

    @property
    def attention_rows(self) -> list[tuple[int, int]]:
        """Every attention block as (layer, 1-based block in the layer), in the order the model runs them."""
        return [(f, b) for f in self.attention_layers for b in range(1, 2 + len(self.later_blocks.get(f, [])))]

    def block_name(self, layer: int, b: int) -> str:
        """Block b of `layer` as the model names it: the layer's module for its first block, else the block's module."""
        return self.names[layer - 1] if b == 1 else f"{self.names[layer - 1]}.{self.later_blocks[layer][b - 2][0]}"


def _decoder_layers(model: nn.Module, specs: list[Spec], counts: dict[str, int], text_type: str | None,
                    looped: bool) -> list[nn.Module]:
    """The decoder layers, in order: each declared hidden-state module, or the ModuleList entry that wraps it.

    Declared modules may sit in more than one list (a multi-token-prediction head reuses the layer
    class; a vision or audio tower uses the same class, or as many layers): the list that holds as many
    of them as one of `counts` (config field -> number of layers) is the decoder's, and of several such,
    the one whose innermost model is the text model (its config's model type is `text_type`).
    Where no list holds as many as the count (it counts calls: some layers run several times), or the
    model is `looped`, the layers are the calls the model makes, in order (`_calls`).
    """
    groups: dict[str, list[nn.Module]] = {}  # list name ("" for none) -> its layers, in order
    names = dict(model.named_modules())
    for name, module in model.named_modules():
        if not any(s.matches(name, module) for s in specs):
            continue
        # The outermost entry of a ModuleList on the way down to the module stands for it.
        parts, owner, layer = name.split("."), "", module
        for i in range(1, len(parts)):
            parent = names.get(".".join(parts[:i]))
            if isinstance(parent, nn.ModuleList) and parts[i].isdigit():
                owner, layer = ".".join(parts[:i]), parent[int(parts[i])]
                break
        group = groups.setdefault(owner, [])
        if all(layer is not seen for seen in group):
            group.append(layer)
    if not groups:
        raise LayoutError(f"cannot find the decoder layers of {type(model).__name__} (nothing matches its declared hidden-state modules)")
    if not counts and not looped:
        return max(groups.values(), key=len)
    matching = [layers for layers in groups.values() if len(layers) in counts.values()]
    if len(matching) > 1:
        owners = _innermost_models(model)
        text = [layers for layers in matching if getattr(owners[id(layers[0])].config, "model_type", None) == text_type]
        matching = text or matching
    if matching and not looped:
        return matching[0]
    calls = _calls(model, [layer for layers in groups.values() for layer in layers])
    if len(calls) > len({id(layer) for layer in calls}) and (looped or len(calls) in counts.values()):
        return calls
    found = ", ".join(f"{len(v)} in {k or 'no list'}" for k, v in groups.items())
    raise LayoutError(
        f"{type(model).__name__}: its config has {', '.join(f'{k}={n}' for k, n in counts.items())}, the modules of its declared "
        f"decoder-layer class are {found}, and one forward calls them {len(calls)} times"
    )


def _calls(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The calls of `layers` that one forward of `model` on two tokens makes, in order (a module once per call).

    The order of a loop is the model's code, not its config's numbers (Inkling2-loop restarts every pass from the
    loop's input; HRM alternates two stacks), so it is read from the model as it runs, as transformers' recorder
    reads it. Layers of a tower the text input does not reach make no call.
    """
    import torch

    calls: list[nn.Module] = []
    handles = [layer.register_forward_pre_hook(lambda module, args: calls.append(module)) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=input_device(model)), use_cache=False)
    except Exception as e:  # noqa: BLE001 - any failure of the model's own forward, said in one line
        text = str(e).strip().splitlines()
        raise LayoutError(f"{type(model).__name__}: a forward on two tokens, to find the order its layers run in, "
                          f"failed: {type(e).__name__}: {text[0] if text else ''}") from e
    finally:
        for handle in handles:
            handle.remove()
    return calls


def input_device(model: nn.Module):
    """Where `model` takes its input ids: the execution device of its input embeddings."""
    import torch

    embedding = model.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return embedding.weight.device


def _innermost_models(model: nn.Module) -> dict[int, nn.Module]:
    """id of each module -> the innermost `PreTrainedModel` that holds it (a tower, the text model, the whole)."""
    owners = {}
    for sub in pretrained_models(model):  # outer models come first: an inner one overrides them
        for module in sub.modules():
            owners[id(module)] = sub
    return owners


def layer_type_names(config, num_layers: int) -> list[str] | None:
    """The model's own name for each decoder layer's type, or None when its config names none."""
    for key in LAYER_TYPE_FIELDS:
        types = getattr(config, key, None)
        if isinstance(types, (list, tuple)) and len(types) == num_layers and all(isinstance(t, str) for t in types):
            return list(types)
    return None


def model_layout(model: nn.Module) -> ModelLayout:
    """Decoder layers, softmax-attention layers (1-based), their attention modules and gate sites, and the view
    their states and maps are read through.

    Raises `LayoutError` (one line) when the model's declaration does not let them be found.
    """
    config = text_config(model.config)
    if (parallel := _parallel_layout(model)) is not None:
        return parallel
    declared = completed_declaration(model)
    # An encoder-decoder's config counts the encoder's layers as num_hidden_layers; its causal LM is the decoder
    # (decoder_layers; ProphetNet's num_decoder_layers).
    # A declaration may name its own count (Longcat-Flash's layers hold two attention blocks each: num_layers).
    keys = [s.num_layers_key for s in declared["hidden_states"] if s.num_layers_key] or ["num_hidden_layers", "decoder_layers", "num_decoder_layers"]
    counts = {key: n for key in keys if isinstance(n := getattr(config, key, None), int)}
    passes_field = LOOPED.get(getattr(config, "model_type", None))
    looped = passes_field is not None and getattr(config, passes_field, 1) > 1
    layers = _decoder_layers(model, declared["hidden_states"], counts, getattr(config, "model_type", None), looped)
    is_attention = softmax_attention(declared["attentions"])
    attention_modules, gates, later_blocks = {}, {}, {}
    for layer, module in enumerate(layers, start=1):
        blocks = declared_modules(module, is_attention)
        if not blocks:
            continue
        (where, attention), *later = blocks
        attention_modules[layer] = attention
        if later:
            later_blocks[layer] = later
        if (site := gate_site(config, attention)) is not None:
            site.name = f"{where}.{site.name}".strip(".")
            gates[layer] = site
    paths = {id(m): n for n, m in model.named_modules()}
    return ModelLayout(layers, _layer_types(model, config, layers, attention_modules), attention_modules, gates,
                       names=[paths[id(module)] for module in layers], later_blocks=later_blocks,
                       is_attention=is_attention, weights_on_request=bool(declared["legacy"]),
                       view=view_of(pretrained_models(model)),
                       weights_index=next((s.index for s in declared["attentions"] if s.index is not None), 1))


def _layer_types(model: nn.Module, config, layers: list[nn.Module], attention_modules: dict[int, nn.Module]) -> list[str]:
    """Each layer's type as its config names it, or "full_attention" for an attention layer and the class's name for
    another where the config names none. Per-layer config fields list the modules (in the order the model holds them),
    not the calls of a loop."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    modules = sorted({id(module): module for module in layers}.values(), key=lambda m: position[id(m)])
    module_types = layer_type_names(config, len(modules))
    if module_types is not None:
        of_module = {id(m): t for m, t in zip(modules, module_types)}
        return [of_module[id(module)] for module in layers]
    return ["full_attention" if layer in attention_modules else type(module).__name__
            for layer, module in enumerate(layers, start=1)]


def _parallel_layout(model: nn.Module) -> ModelLayout | None:
    """The layout of a model whose layers are entries of parallel lists (`PARALLEL_LAYERS`), or None.

    Its attention (XLM's `MultiHeadAttention`) returns weights only when the model is called with
    `output_attentions=True`, as a legacy class's; every layer is an attention layer.
    """
    recorded = None
    for sub in pretrained_models(model):  # the causal LM shares its base model's model type: the one with the lists
        record = PARALLEL_LAYERS.get(getattr(getattr(sub, "config", None), "model_type", None))
        if record is None:
            continue
        recorded = record
        starts, ends = (getattr(sub, name, None) for name in record)
        if not (isinstance(starts, nn.ModuleList) and isinstance(ends, nn.ModuleList) and len(starts) == len(ends) > 0):
            continue
        layers, n = list(ends), len(ends)
        attention_modules = {layer: starts[layer - 1] for layer in range(1, n + 1)}
        paths = {id(m): name for name, m in model.named_modules()}
        return ModelLayout(layers, ["full_attention"] * n, attention_modules, {}, names=[paths[id(m)] for m in layers],
                           entries=list(starts), weights_on_request=True)
    if recorded is not None:
        raise LayoutError(f"{type(model).__name__}: no parallel lists {recorded[0]!r} and {recorded[1]!r} of one "
                          f"length hold its layers")
    return None
