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
- `LEGACY_DECLARATIONS`: model types whose classes predate the declaration (Bloom, Falcon, GPT-Neo, MPT,
  OpenAI-GPT, ...): their decoder-layer and attention classes, by name in the model's own module
  (`legacy_declaration`), which `declaration` reads where a submodel declares nothing: the analysis reads their
  maps, and `convert` gates their attention, from the same record.
- `REFUSED`: the model types neither `analyze` nor `convert` reads, with the reason each says in one line (inputs that
  are no text tokens, attention that is no softmax map of the input's tokens).
- `transformers_classes`: which transformers classes serve a model type (its base model and causal LM), the one
  answer `analyze` (the class it builds MODEL with), `convert` (whether a type is gated by declaration) and the
  declared classes (the class each is made from) ask.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

# Classes declared under "attentions" whose forward is no softmax attention, with what it is instead.
NOT_SOFTMAX = {"MiniMaxLightningAttention": "linear (lightning) attention"}

# transformers model types that declare nothing because their classes predate the declaration, although their
# attention returns its weights (when the model is called with `output_attentions=True`): decoder-layer class,
# attention class, and the attribute the attention sits under where a layer holds another of the same class
# (an encoder-decoder's decoder layer also holds its cross-attention, which a causal LM never runs).
# A release that declares the class is read from its declaration instead; the record serves the older ones.
# tests/test_analyze_architectures.py fails for a record once the floor release declares it: delete it then.
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
    "xlnet": ("XLNetLayer", "XLNetRelativeAttention", None),  # time-major: the analysis's `model_records.VIEWS`
}

# transformers model types that neither command reads, with the reason, said in one line instead of a wrong number
# or a traceback: inputs that are no text tokens a tokenizer gives, or attention that is no [B, H, T, T] softmax map
# per decoder layer of the input's tokens. A whole MusicGen checkpoint ("musicgen") maps to its decoder's class.
AUDIO_CODES = ("its inputs are audio codec codes, one row of input_ids per codebook ([B * num_codebooks, T]), not "
               "text tokens")
ASSISTANT = ("a speculative-decoding assistant: its inputs are its target model's hidden states and key/value cache "
             "(inputs_embeds, shared_kv_states), not input_ids, which its forward ignores; every layer attends to the "
             "target's keys")
REFUSED = {
    "reformer": "its local and LSH attention return weights per chunk and hash bucket, not a [T, T] map of the input",
    "blt": "its global transformer attends over the patches its entropy model cuts the bytes into ([P, P] maps, P "
           "not the input's T tokens), between byte-level encoder and decoder stacks of their own",
    "musicgen": AUDIO_CODES,  # its causal LM is MusicgenForCausalLM, the decoder of a text-to-audio model
    "musicgen_decoder": AUDIO_CODES,
    "musicgen_melody": AUDIO_CODES,
    "musicgen_melody_decoder": AUDIO_CODES,
    "gemma4_assistant": ASSISTANT,  # Gemma4AssistantForCausalLM: a drafter for speculative decoding
    "gemma4_unified_assistant": ASSISTANT,
}


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


def legacy_declaration(model: nn.Module) -> dict[str, list[Spec]] | None:
    """What `LEGACY_DECLARATIONS` records for `model` (a `PreTrainedModel`), as a declaration; None where no record
    applies (another type, or a release whose classes are named otherwise)."""
    record = LEGACY_DECLARATIONS.get(getattr(getattr(model, "config", None), "model_type", None))
    if record is None:
        return None
    from ..configuration.declared import transformers_class

    layer, attention, attribute = record
    # The classes' module is the transformers class's (a model gated by declaration is a subclass made elsewhere).
    source = transformers_class(type(model)) or type(model)
    module = importlib.import_module(source.__module__)
    classes = getattr(module, layer, None), getattr(module, attention, None)
    if None in classes:
        return None
    return {"hidden_states": [Spec(target_class=classes[0])],
            "attentions": [Spec(target_class=classes[1], layer_name=attribute)]}


def declaration(model: nn.Module) -> dict[str, list[Spec]]:
    """Key -> specs of `model`: the declarations of every `PreTrainedModel` in it (or, where one declares nothing,
    its `LEGACY_DECLARATIONS` record), merged, outer first; a key no submodel declares is absent."""
    merged: dict[str, list[Spec]] = {}
    for sub in pretrained_models(model):
        for key, found in (own_declaration(sub) or legacy_declaration(sub) or {}).items():
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


def transformers_classes(model_type: str, architectures=()) -> dict[str, type]:
    """transformers' own classes of a model type, as its Auto classes name them (never another package's that
    registered the same type, as fla does `mamba2` and `bitnet`): {"AutoModel": ..., "AutoModelForCausalLM": ...}.

    A composite model's text config saved alone (Mllama's mllama_text_model, Emu3's emu3_text_model) has no entry of
    its own: its class is one its config names in `architectures`, or its composite type's entry, where that class
    is built from this config."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    def takes_this_config(cls) -> bool:
        return isinstance(cls, type) and getattr(getattr(cls, "config_class", None), "model_type", None) == model_type

    found = {}
    for auto, names in (("AutoModel", MODEL_MAPPING_NAMES), ("AutoModelForCausalLM", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        name = names.get(model_type)
        if isinstance(name, str) and isinstance(cls := getattr(transformers, name, None), type):
            found[auto] = cls
            continue
        named = [getattr(transformers, a, None) for a in architectures or () if isinstance(a, str)]
        if auto == "AutoModelForCausalLM" and (cls := next((c for c in named if takes_this_config(c)), None)):
            found[auto] = cls
            continue
        for key, name in names.items():
            if model_type.startswith(f"{key}_") and takes_this_config(cls := getattr(transformers, name, None)):
                found[auto] = cls
    return found
