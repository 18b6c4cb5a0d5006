"""Where a model's decoder layers, softmax-attention modules and attention gates are.

transformers declares, on every model class, which module class yields each decoder layer's hidden
states and which yields attention weights (`_can_record_outputs`, the mechanism behind
`output_hidden_states` and `output_attentions`). The analysis reads that declaration, as
transformers' own recorder does; the package's three families declare it the same way. Where a
declaration does not say enough, a record below says it, as data, in this one place:

- `UNDECLARED`: model types that declare nothing because they have no attention (Mamba, RWKV):
  their decoder layer is the class in `_no_split_modules`, and no module is attention.
- `PACKAGE_DECLARATIONS`: packages whose models declare nothing (fla): their decoder layer is the
  class in `_no_split_modules`, their attention the package's softmax-attention class.
- `NOT_SOFTMAX`: classes declared under "attentions" that compute no softmax map (MiniMax's
  lightning attention is linear attention).
- `UNREADABLE`: model types whose attention weights are no per-layer [T, T] map of the input
  (Reformer's chunks and hash buckets), or whose inputs are no text tokens (MusicGen's decoder reads audio
  codec codes, Gemma 4's assistants their target model's states): refused with the reason, in one line.
- `REQUIRED_FIELDS`: config fields a model needs set, have no default, and the analysis cannot choose (X-MOD's input
  language): a checkpoint without one is refused in one line that names the field and its choices.
- `RESIDUAL_HEADS`: hyper-connection models (DeepSeek-V4) keep several residual streams; the module
  that reduces them before the final norm is where the residual state is read through.
- `PROMPT_PREFIXES`: models that put learned prompt tokens before every input (CPM-Ant): read past them.
- `MAIN_STREAMS`: models whose residual carries prediction streams after the main one (ProphetNet).
- `OUTPUT_GATES`: attention output gates transformers ships (their projection and activation).
- `TIME_MAJOR`: model types that keep their states time-major (XLNet: `[T, B, D]`, weights `[T, T, B, H]`): read in
  that layout and permuted as transformers permutes what it returns.
- `PARALLEL_LAYERS`: model types whose layers are no modules (XLM: parallel lists of attention, norm and feed-forward
  modules): the list whose entry starts each layer and the one whose entry's output is the layer's output.
- `LOOPED`: model types whose layers run several times in one forward although their declared layer count
  counts modules, not calls (Dory's recurrent section): their layers are found in the order they run.
- `LEGACY_DECLARATIONS`: model types whose classes predate `_can_record_outputs` (Bloom, Falcon,
  GPT-Neo, MPT, ...): their decoder-layer and attention classes, by name in the model's own module.
  Their attention returns its weights only when the model is called with `output_attentions=True`,
  which `Capture` then passes (`ModelLayout.weights_on_request`).

Decoder layers: the entries of the `ModuleList` that holds (or is made of) the declared
hidden-state modules, one per `config.num_hidden_layers` (an encoder-decoder's `decoder_layers`, or
the count the declaration names), in order; of two such lists (a vision tower as deep as the text
model), the text model's. A declared module nested in a wrapper (Zamba2's hybrid layer wraps its
Mamba layer) stands for the wrapper, whose output it gives.

A model that runs some layers several times in one forward (Inkling2-loop's loop layers, HRM's two stacks run
in cycles, Dory's recurrent section) declares the number of calls, not of modules (`total_num_hidden_layers`,
HRM's `num_hidden_layers`), or is named in `LOOPED`. Its decoder layers are then its layer calls, in the order
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

# ---------------------------------------------------------------- records: what declarations do not say

# transformers model types that declare no attention output, because they have no attention (xLSTM declares
# its hidden states only).
UNDECLARED = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
# Packages whose model classes declare nothing: the module of their softmax attention class.
PACKAGE_DECLARATIONS = {"fla": {"attentions": ("fla.layers.attn", "Attention")}}
# Classes declared under "attentions" whose output is no softmax attention map.
NOT_SOFTMAX = {"MiniMaxLightningAttention": "linear (lightning) attention"}
# transformers model types that declare nothing because their classes predate the declaration, although their
# attention returns its weights (when the model is called with `output_attentions=True`): decoder-layer class,
# attention class, and the attribute the attention sits under where a layer holds another of the same class
# (an encoder-decoder's decoder layer also holds its cross-attention, which a causal LM never runs).
# A release that declares the class is read from its declaration instead (`declaration`); the record serves the
# older ones. tests/test_analyze_architectures.py fails for a record once the floor release declares it: delete it then.
LEGACY_DECLARATIONS = {
    "bloom": ("BloomBlock", "BloomAttention", None),
    "falcon": ("FalconDecoderLayer", "FalconAttention", None),
    "gpt_neo": ("GPTNeoBlock", "GPTNeoSelfAttention", None),
    "mpt": ("MptBlock", "MptAttention", None),
    "openai-gpt": ("Block", "Attention", None),
    "cpmant": ("CpmAntTransformerBlock", "CpmAntAttention", None),
    "prophetnet": ("ProphetNetDecoderLayer", "ProphetNetNgramSelfAttention", "self_attn"),  # its map: the main stream's
    "gpt_neox_japanese": ("GPTNeoXJapaneseLayer", "GPTNeoXJapaneseAttention", None),
    "megatron-bert": ("MegatronBertLayer", "MegatronBertSelfAttention", None),
    "rembert": ("RemBertLayer", "RemBertSelfAttention", None),
    "roformer": ("RoFormerLayer", "RoFormerSelfAttention", None),
    "mvp": ("MvpDecoderLayer", "MvpAttention", "self_attn"),
    "trocr": ("TrOCRDecoderLayer", "TrOCRAttention", "self_attn"),
    "xlnet": ("XLNetLayer", "XLNetRelativeAttention", None),  # time-major: TIME_MAJOR
}
# transformers model types whose attention weights are not one [B, H, T, T] map per decoder layer of the input's
# tokens, or whose inputs are no text tokens a tokenizer gives, with the reason, said in one line instead of a wrong
# number or a traceback.
AUDIO_CODES = ("its inputs are audio codec codes, one row of input_ids per codebook ([B * num_codebooks, T]), not "
               "text tokens")
ASSISTANT = ("a speculative-decoding assistant: its inputs are its target model's hidden states and key/value cache "
             "(inputs_embeds, shared_kv_states), not input_ids, which its forward ignores; every layer attends to the "
             "target's keys")
UNREADABLE = {
    "reformer": "its local and LSH attention return weights per chunk and hash bucket, not a [T, T] map of the input",
    "blt": "its global transformer attends over the patches its entropy model cuts the bytes into ([P, P] maps, P "
           "not the input's T tokens), between byte-level encoder and decoder stacks of their own",
    "musicgen_decoder": AUDIO_CODES,  # MusicgenForCausalLM: the decoder of a text-to-audio model
    "musicgen_melody_decoder": AUDIO_CODES,
    "gemma4_assistant": ASSISTANT,  # Gemma4AssistantForCausalLM: a drafter for speculative decoding
    "gemma4_unified_assistant": ASSISTANT,
}
# Config fields a model type needs set and has no default for, which the analysis cannot choose for the user: the field,
# the config field that lists its choices, and what the model does with it. X-MOD runs one language adapter per layer,
# chosen by the input's language: transformers' own forward raises without one, and only the user knows the inputs'.
REQUIRED_FIELDS = {"xmod": ("default_language", "languages", "the language adapter every layer runs")}
# Attention output gates transformers ships, which no declaration names: attention class -> the gate's linear map
# (named under the attention module as the model names its parameters; where releases put it in different places,
# each name in turn, the first the model has) and the activation the model applies to its output, `[B, T, H]` (a score
# per head) or `[B, T, H * W]`. Qwen3-Next's gate, half of q_proj, is found by its width. Inkling2's gate moved into its
# output projection in transformers 5.24 (`Inkling2GatedOutputProjection`); 5.23 keeps it on the attention, the same
# map of the same input, applied to the same output.
INKLING2_GATE = ("o_proj.gate_proj", "gate_proj")
OUTPUT_GATES = {
    "Lfm3Attention": ("g_proj", "sigmoid"),
    "BailingHybridAttention": ("g_proj", "sigmoid"),
    "LagunaAttention": ("g_proj", "softplus"),
    "Dots3NoteTextAttention": ("g_proj", "sigmoid"),
    "HYV4Attention": ("gate_proj", "sigmoid"),
    "Inkling2SlidingAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2FullAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2LoopSlidingAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2LoopFullAttention": (INKLING2_GATE, "sigmoid"),
}
# Hyper-connections: model types whose decoder layers pass several residual streams on ([B, T, N, D]) and reduce them
# to one before the final norm with a module of their own (the attribute of the text model named here). The residual
# state X[l] is read through it, as the model reads its last one.
RESIDUAL_HEADS = {"deepseek_v4": "hc_head", "hy_v4": "hc_head"}
# Model types that put learned prompt tokens before every input (CPM-Ant: `config.prompt_length` of them) and drop
# them from the hidden states and maps they return: the residual and maps are read past them, as transformers returns
# them, so token 0 is the input's first token.
PROMPT_PREFIXES = {"cpmant": "prompt_length"}
# Model types whose decoder layers carry prediction streams after the main one, `[B, (1 + n) T, D]` (ProphetNet's
# `config.ngram` n-gram streams): the residual is read as the main stream, the first T positions, as transformers
# returns it.
MAIN_STREAMS = {"prophetnet": "ngram"}
# Model types whose modules keep their states time-major, `[T, B, D]`: the einsum axes of the attention weights (i query,
# j key, b batch, n head) and where they are in the attention module's output (XLNet's is (h, g, weights), g None
# without a target mapping). transformers permutes both to `[B, T, D]` and `[B, H, T, T]` before returning them; the
# capture reads them in the model's layout and permutes them the same way (and an edit of the residual goes back).
TIME_MAJOR = {"xlnet": ("ijbn", 2)}
# Model types whose layers are no modules: the base model holds parallel lists of per-layer modules and runs entry i of
# each in turn (XLM: attentions, layer_norm1, ffns, layer_norm2). The list whose entry i starts layer i + 1 (its
# attention, whose input is the layer's input) and the list whose entry i's output is that layer's output. XLM then
# multiplies that output by its padding mask in place, as its forward goes on: the capture reduces a residual state only
# when the next is read or the model's forward has returned, so it reads what transformers returns.
PARALLEL_LAYERS = {"xlm": ("attentions", "layer_norm2")}
# Model types whose decoder layers run several times in one forward while their config counts modules: the config
# field that counts the passes (a model with one pass runs each layer once). Those that count calls need no record.
LOOPED = {"dory": "n_recurrent_loops"}
# Config fields that name each decoder layer's type, in order of preference.
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type")


class LayoutError(ValueError):
    """A model whose layout cannot be read; the message is one line for the user."""


# ---------------------------------------------------------------- reading a declaration


@dataclass(frozen=True)
class Spec:
    """One entry of a `_can_record_outputs` value: a class, or a class-name suffix, optionally under a named submodule."""

    target_class: type | None = None
    class_name: str | None = None
    layer_name: str | None = None
    # The config field that counts these modules, where it is not num_hidden_layers (Longcat-Flash: num_layers).
    num_layers_key: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        hit = (self.target_class is not None and isinstance(module, self.target_class)) or (
            self.class_name is not None and name.endswith(self.class_name)
        )
        if hit and self.layer_name is not None:
            return f".{self.layer_name.strip('.')}." in f".{name}."
        return hit


def _specs(value) -> list[Spec]:
    """`_can_record_outputs[key]` (a class, a class name, an `OutputRecorder`, or a list of them) as `Spec`s."""
    out = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, type):
            out.append(Spec(target_class=item))
        elif isinstance(item, str):
            out.append(Spec(class_name=item))
        else:  # transformers' OutputRecorder
            key = getattr(item, "num_hidden_layers_key", None)
            out.append(Spec(getattr(item, "target_class", None), getattr(item, "class_name", None),
                            getattr(item, "layer_name", None), None if key == "num_hidden_layers" else key))
    return out


def _pretrained_models(model: nn.Module) -> Iterator[nn.Module]:
    """`model` and every `PreTrainedModel` inside it (a composite model declares per submodel)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            yield module


def _package_declaration(module: nn.Module) -> dict[str, list[Spec]] | None:
    package = type(module).__module__.split(".")[0]
    record = PACKAGE_DECLARATIONS.get(package)
    if record is None:
        return None
    declared = {}
    for key, (module_name, class_name) in record.items():
        declared[key] = [Spec(target_class=getattr(importlib.import_module(module_name), class_name))]
    return declared


def _legacy_declaration(module: nn.Module) -> dict[str, list[Spec]] | None:
    record = LEGACY_DECLARATIONS.get(getattr(getattr(module, "config", None), "model_type", None))
    if record is None:
        return None
    layer, attention, attribute = record
    source = importlib.import_module(type(module).__module__)
    classes = getattr(source, layer, None), getattr(source, attention, None)
    if None in classes:  # a release whose classes are named otherwise: no record applies
        return None
    return {"hidden_states": [Spec(target_class=classes[0])],
            "attentions": [Spec(target_class=classes[1], layer_name=attribute)]}


def _no_split_specs(module: nn.Module) -> list[Spec]:
    # accelerate's `_no_split_modules`: the class names of the blocks a model is made of, its decoder layers.
    names = getattr(module, "_no_split_modules", None) or []
    return [Spec(class_name=None, target_class=c) for c in {type(m) for m in module.modules() if type(m).__name__ in names}]


def declaration(model: nn.Module) -> dict[str, list[Spec]]:
    """The hidden-state and attention specs of `model`: its declaration, merged over submodels, completed by the records.

    Key "legacy": one entry per submodel read from `LEGACY_DECLARATIONS` (its attention returns weights on request).
    """
    declared: dict[str, list[Spec]] = {"hidden_states": [], "attentions": [], "legacy": []}
    undeclared_attention = []
    for sub in _pretrained_models(model):
        own = {k: _specs(v) for k, v in (getattr(sub, "_can_record_outputs", None) or {}).items()}
        package = _package_declaration(sub)
        model_type = getattr(getattr(sub, "config", None), "model_type", None)
        if model_type in UNREADABLE:
            raise LayoutError(f"{type(model).__name__} cannot be analysed: {UNREADABLE[model_type]}")
        if (required := REQUIRED_FIELDS.get(model_type)) and getattr(sub.config, required[0], None) is None:
            name, choices, use = required
            raise LayoutError(
                f"{type(model).__name__} cannot be analysed: its config sets no `{name}`, which chooses {use}; set it "
                f"in the checkpoint's config.json to the inputs' (one of {list(getattr(sub.config, choices, []))})")
        if not own and (legacy := _legacy_declaration(sub)) is not None:
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
class GateSite:
    """Where an attention module's gate scores come from.

    kind "attn_gate": our `self_attn.attn_gate`, whose forward returns the gate's logits flat and whose
    `gate_scores` activates them and gives them heads. kind "q_proj": transformers' Qwen3-Next/Qwen3.5
    output gate, the second half of each head's q_proj output, `sigmoid`-ed. kind "projection": a linear
    map of `OUTPUT_GATES` whose output, `activation`-ed, is the gate (`[B, T, H]` or `[B, T, H * W]`).
    `name`: the gate's module under the decoder layer, as the model names its parameters.
    """

    kind: str
    module: nn.Module
    num_heads: int = 0
    head_dim: int = 0
    activation: str = "sigmoid"
    name: str = ""


@dataclass
class ModelLayout:
    layers: nn.ModuleList | list[nn.Module]
    layer_types: list[str]
    full_attention_layers: list[int]  # 1-based: the layers that contain softmax attention
    attention_modules: dict[int, nn.Module]  # 1-based attention layer -> its softmax-attention module
    gates: dict[int, GateSite]  # 1-based attention layer -> gate site
    # The attention returns its weights only when the model is called with `output_attentions=True` (a legacy class).
    weights_on_request: bool = False
    # Reduces the hyper-connection streams `[B, T, N, D]` of a residual state to `[B, T, D]` (`RESIDUAL_HEADS`).
    residual_head: nn.Module | None = None
    # Prompt positions before the input's tokens (`PROMPT_PREFIXES`), left out of the residual and the maps.
    prefix: int = 0
    # Streams the residual carries, the main one first (`MAIN_STREAMS`): 1 + ProphetNet's n-gram streams.
    streams: int = 1
    # Whether a module is a declared softmax attention (`attention_in` asks it again of a layer).
    is_attention: Callable[[str, nn.Module], bool] | None = None
    # Each decoder layer's module, as the model names it ("model.layers.3"), and its pass: the module's k-th call in
    # one forward (1 but in a loop, where a module that runs k times is k layers).
    names: list[str] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    # Attention blocks after the first in one layer (Longcat-Flash runs `self_attn.0`, then `self_attn.1`): 1-based
    # layer -> (name under the layer, module) of each, in the order the layer holds and calls them. Each is a row of
    # its own (`attention_rows`); `attention_modules` and `gates` are the first block's.
    later_blocks: dict[int, list[tuple[str, nn.Module]]] = field(default_factory=dict)
    # The module whose call starts each decoder layer, its input X[l-1]: the layer itself but where the layer is no
    # module (`PARALLEL_LAYERS`: XLM's attention starts it, its last norm ends it).
    entries: list[nn.Module] = field(default_factory=list)
    # States kept time-major (`TIME_MAJOR`): the residual `[T, B, D]`, the weights in these einsum axes at this index of
    # the attention module's output ("bnij" at 1: `[B, H, T, T]` second, as transformers' attention modules return them).
    time_major: bool = False
    weights_axes: str = "bnij"
    weights_index: int = 1

    def __post_init__(self) -> None:
        if not self.entries:
            self.entries = list(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attention_in(self, l: int) -> nn.Module | None:
        """The softmax-attention module layer l (1-based) holds now: a model may replace it as it runs (BigBird
        swaps its block-sparse attention for full attention at inputs too short for blocks)."""
        if not self.is_attention:
            return self.attention_modules.get(l)
        blocks = _layer_attentions(self.layers[l - 1], self.is_attention)
        return blocks[0][1] if blocks else None

    @property
    def attention_rows(self) -> list[tuple[int, int]]:
        """Every attention block as (1-based layer, 1-based block in the layer), in the order the model runs them."""
        return [(f, b) for f in self.full_attention_layers for b in range(1, 2 + len(self.later_blocks.get(f, [])))]

    def block_name(self, l: int, b: int) -> str:
        """Block b of layer l as the model names it: the layer's module for its first block, else the block's module."""
        return self.names[l - 1] if b == 1 else f"{self.names[l - 1]}.{self.later_blocks[l][b - 2][0]}"


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
    for sub in _pretrained_models(model):  # outer models come first: an inner one overrides them
        for module in sub.modules():
            owners[id(module)] = sub
    return owners


def _softmax_attention(specs: list[Spec]):
    def is_attention(name: str, module: nn.Module) -> bool:
        return type(module).__name__ not in NOT_SOFTMAX and any(s.matches(name, module) for s in specs)

    return is_attention


def _layer_attentions(layer: nn.Module, is_attention) -> list[tuple[str, nn.Module]]:
    """The softmax-attention modules in `layer`'s tree (shared modules included), each with its name under the
    layer, in the order the layer holds them (Longcat-Flash's `self_attn.0`, `self_attn.1`)."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in layer.named_modules(remove_duplicate=False):
        if is_attention(name, module) and id(module) not in found:
            found[id(module)] = (name, module)
    return list(found.values())


def layer_type_names(config, num_layers: int) -> list[str] | None:
    """The model's own name for each decoder layer's type, or None when its config names none."""
    for key in LAYER_TYPE_FIELDS:
        types = getattr(config, key, None)
        if isinstance(types, (list, tuple)) and len(types) == num_layers and all(isinstance(t, str) for t in types):
            return list(types)
    return None


def _gate_site(config, attention: nn.Module) -> GateSite | None:
    gate = getattr(attention, "attn_gate", None)
    if isinstance(gate, nn.Module):
        return GateSite("attn_gate", gate, name="attn_gate")
    q_proj, head_dim = getattr(attention, "q_proj", None), getattr(attention, "head_dim", None)
    num_heads = getattr(attention, "num_heads", None) or getattr(config, "num_attention_heads", None)
    if (record := OUTPUT_GATES.get(type(attention).__name__)) is not None:
        names, activation = record
        name = next((n for n in ((names,) if isinstance(names, str) else names) if _has_submodule(attention, n)), None)
        projection = attention.get_submodule(name) if name else None
        if isinstance(projection, nn.Linear) and num_heads and projection.out_features % num_heads == 0:
            return GateSite("projection", projection, num_heads, projection.out_features // num_heads, activation, name)
        return None  # the model was built without its gate (Lfm3's `use_attention_gate=False`)
    if isinstance(q_proj, nn.Linear) and head_dim and num_heads and q_proj.out_features == 2 * num_heads * head_dim:
        return GateSite("q_proj", q_proj, num_heads, head_dim, name="q_proj")
    return None


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


def model_layout(model: nn.Module) -> ModelLayout:
    """Decoder layers, softmax-attention layers (1-based), their attention modules and gate sites.

    Raises `LayoutError` (one line) when the model's declaration does not let them be found.
    """
    config = text_config(model)
    if (parallel := _parallel_layout(model)) is not None:
        return parallel
    declared = declaration(model)
    # An encoder-decoder's config counts the encoder's layers as num_hidden_layers; its causal LM is the decoder
    # (decoder_layers; ProphetNet's num_decoder_layers).
    # A declaration may name its own count (Longcat-Flash's layers hold two attention blocks each: num_layers).
    keys = [s.num_layers_key for s in declared["hidden_states"] if s.num_layers_key] or ["num_hidden_layers", "decoder_layers", "num_decoder_layers"]
    counts = {key: n for key in keys if isinstance(n := getattr(config, key, None), int)}
    passes_field = LOOPED.get(getattr(config, "model_type", None))
    looped = passes_field is not None and getattr(config, passes_field, 1) > 1
    layers = _decoder_layers(model, declared["hidden_states"], counts, getattr(config, "model_type", None), looped)
    is_attention = _softmax_attention(declared["attentions"])
    attention_modules, gates, later_blocks = {}, {}, {}
    for l, layer in enumerate(layers, start=1):
        blocks = _layer_attentions(layer, is_attention)
        if not blocks:
            continue
        (where, attention), *later = blocks
        attention_modules[l] = attention
        if later:
            later_blocks[l] = later
        if (site := _gate_site(config, attention)) is not None:
            site.name = f"{where}.{site.name}".strip(".")
            gates[l] = site
    # Per-layer config fields list the modules (in the order the model holds them), not the calls of a loop.
    position = {id(m): i for i, m in enumerate(model.modules())}
    modules = sorted({id(layer): layer for layer in layers}.values(), key=lambda m: position[id(m)])
    module_types = layer_type_names(config, len(modules))
    if module_types is not None:
        of_module = {id(m): t for m, t in zip(modules, module_types)}
        names = [of_module[id(layer)] for layer in layers]
    else:
        names = ["full_attention" if l in attention_modules else type(layer).__name__ for l, layer in enumerate(layers, start=1)]
    paths = {id(m): n for n, m in model.named_modules()}
    calls: dict[int, int] = {}  # id of a module -> its calls so far
    passes = []
    for layer in layers:
        calls[id(layer)] = calls.get(id(layer), 0) + 1
        passes.append(calls[id(layer)])
    axes, index = TIME_MAJOR.get(getattr(config, "model_type", None), ("bnij", 1))
    return ModelLayout(layers, names, sorted(attention_modules), attention_modules, gates, bool(declared["legacy"]),
                       _residual_head(model), _prefix(config), _streams(config), is_attention,
                       [paths[id(layer)] for layer in layers], passes, later_blocks,
                       time_major=axes != "bnij", weights_axes=axes, weights_index=index)


def _parallel_layout(model: nn.Module) -> ModelLayout | None:
    """The layout of a model whose layers are entries of parallel lists (`PARALLEL_LAYERS`), or None.

    Its attention (XLM's `MultiHeadAttention`) returns weights only when the model is called with
    `output_attentions=True`, as a legacy class's; every layer is an attention layer.
    """
    recorded = None
    for sub in _pretrained_models(model):  # the causal LM shares its base model's model type: the one with the lists
        record = PARALLEL_LAYERS.get(getattr(getattr(sub, "config", None), "model_type", None))
        if record is None:
            continue
        recorded = record
        starts, ends = (getattr(sub, name, None) for name in record)
        if not (isinstance(starts, nn.ModuleList) and isinstance(ends, nn.ModuleList) and len(starts) == len(ends) > 0):
            continue
        layers, n = list(ends), len(ends)
        attention_modules = {l: starts[l - 1] for l in range(1, n + 1)}
        paths = {id(m): name for name, m in model.named_modules()}
        return ModelLayout(layers, ["full_attention"] * n, list(range(1, n + 1)), attention_modules, {},
                           weights_on_request=True, names=[paths[id(m)] for m in layers], passes=[1] * n,
                           entries=list(starts))
    if recorded is not None:
        raise LayoutError(f"{type(model).__name__}: no parallel lists {recorded[0]!r} and {recorded[1]!r} of one "
                          f"length hold its layers")
    return None


def _prefix(config) -> int:
    field = PROMPT_PREFIXES.get(getattr(config, "model_type", None))
    return getattr(config, field, 0) if field else 0


def _streams(config) -> int:
    field = MAIN_STREAMS.get(getattr(config, "model_type", None))
    return 1 + getattr(config, field, 0) if field else 1


def _residual_head(model: nn.Module) -> nn.Module | None:
    for sub in _pretrained_models(model):
        attribute = RESIDUAL_HEADS.get(getattr(getattr(sub, "config", None), "model_type", None))
        if attribute is not None and isinstance(getattr(sub, attribute, None), nn.Module):
            return getattr(sub, attribute)
    return None
