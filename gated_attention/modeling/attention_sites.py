"""Where a transformers model's softmax-attention modules and their output projections are, read from its
declarations: the places a gate can be added to a model whose code the package does not own.

- **Attention modules**: what the model's classes declare under "attentions" in `_can_record_outputs`, read
  and merged over every `PreTrainedModel` inside by `recorded_outputs` (the reader the analysis uses too), that
  compute softmax attention (`recorded_outputs.NOT_SOFTMAX`), within the text model (a vision or audio tower's
  attention is not the causal LM's). A module several layers share (Zamba's) is one site.
- **The output projection** of each: the child the model's tensor-parallel plan shards "rowwise" (what
  the plan declares is the attention's last matrix, the one whose input is the heads' output), as wide
  on its output as the attention's input; where the model has no plan, the child of the first name in
  `OUTPUT_PROJECTIONS`. It must be one `nn.Linear` (or transformers' `Conv1D`).
- **The attention's input**: the first parameter of its `forward` (the normed hidden states, which also
  feed its q/k/v projections), as wide as the input of its other projections.

Where a declaration does not say enough, a record here says it, as data:

- `OUTPUT_PROJECTIONS`: the names an attention's output projection has in models without a plan.
- `LATENT_FIELDS`, `LATENT_PROJECTIONS`: what makes an attention a latent one (MLA). Absorbed inference
  (vLLM's MLA kernels) folds each head's value up-projection into the output projection,
  `y = sum_h (W_O^h W_UV^h) sum_j a_hj c_j` over the latent `c`: a per-head scalar gate `g_h` commutes with
  that product and keeps the absorbed form, an elementwise gate sits between the two matrices and breaks it.
  A latent site (`AttentionSite.latent`) therefore takes a headwise gate only (`declared.add_gates` refuses
  another), and its heads are the value heads (`v_head_dim`), not the query/key heads.

A model whose sites cannot be found is an `AttentionSiteError`: one line that names what is missing.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

from ..configuration.declared import text_config, transformers_class
from .recorded_outputs import NOT_SOFTMAX, declaration, declared_by, declared_modules, is_softmax
# An attention's output projection in a model without a tensor-parallel plan, by name, in order of preference.
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "Wo", "wo")
# Config fields (of the text config) whose value makes the attention latent (multi-head latent attention).
LATENT_FIELDS = ("kv_lora_rank",)
# Children that make an attention latent where its config names no such field.
LATENT_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_b_proj", "o_a_proj", "o_b_proj")


class AttentionSiteError(ValueError):
    """A model whose attention cannot be gated by declaration; the message is one line naming what is missing."""


@dataclass
class AttentionSite:
    """One softmax-attention module and the places its gate reads and writes."""

    path: str  # the module's name in the model ("model.layers.0.self_attn")
    attention: nn.Module
    output: str  # its output projection's attribute ("o_proj")
    input_name: str  # the `forward` parameter that holds the attention's input
    in_features: int  # the width of that input: the gate's input
    width: int  # the width of the output projection's input: heads * head_dim
    head_dim: int
    plan_key: str | None = None  # the tensor-parallel plan's entry that names the output projection, if any
    latent: str | None = None  # why it is latent attention (MLA), which takes a headwise gate only; None: it is not

    @property
    def heads(self) -> int:
        return self.width // self.head_dim


def _linear_widths(module: nn.Module) -> tuple[int, int] | None:
    """(input width, output width) of an `nn.Linear` or transformers' `Conv1D` (weight `[in, out]`), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return module.weight.shape[0], module.nf
    return None


def source_name(model: nn.Module) -> str:
    """The model's transformers class name (a declared model's source class)."""
    return (transformers_class(type(model)) or type(model)).__name__


def text_model(model: nn.Module) -> tuple[str, nn.Module]:
    """The part of `model` that is its text model, with its name: the whole model, or the outermost
    `PreTrainedModel` inside whose config is the text config (a multimodal model's language model)."""
    from transformers import PreTrainedModel

    config = model.config
    text = text_config(config)
    if text is config:
        return "", model
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and module.config is text:
            return name, module
    return "", model


def _latent(model: nn.Module, attention: nn.Module) -> str | None:
    config = text_config(model.config)
    for key in LATENT_FIELDS:
        if config.__dict__.get(key) is not None:  # not getattr: a per-layer field refuses to be read globally
            return f"its config sets {key}"
    names = [name for name, _ in attention.named_children() if name in LATENT_PROJECTIONS]
    return f"its attention has {', '.join(names)}" if names else None


def _plan_patterns(model: nn.Module) -> dict[str, tuple[re.Pattern, str]]:
    """The model's tensor-parallel plan (names from the model's root) as regexes, with each entry's style."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    return {key: (re.compile(re.escape(key).replace(r"\*", r"\d+")), str(style)) for key, style in plan.items()}


def _output_projection(path: str, attention: nn.Module, hidden: int | None, plan) -> tuple[str, str | None]:
    """The output projection's attribute under `attention`, and the plan entry that names it (None: by name)."""
    children = dict(attention.named_children())
    declared = []
    for name, child in children.items():
        widths = _linear_widths(child)
        for key, (pattern, style) in plan.items():
            if "rowwise" in style and pattern.fullmatch(f"{path}.{name}") and (widths is None or hidden is None or widths[1] == hidden):
                declared.append((name, key))
                break
    if len(declared) > 1:
        raise AttentionSiteError(f"{type(attention).__name__} has no single output projection: its tensor-parallel plan "
                                 f"shards {', '.join(n for n, _ in declared)} rowwise")  # fmt: skip
    if declared:
        return declared[0]
    for name in OUTPUT_PROJECTIONS:
        if name in children:
            return name, None
    raise AttentionSiteError(
        f"{type(attention).__name__} holds no output projection (none its model's tensor-parallel plan shards "
        f"rowwise, none named {', '.join(OUTPUT_PROJECTIONS)}; its children: {', '.join(children) or 'none'})"
    )


def _input_name(attention: nn.Module) -> str:
    parameters = list(inspect.signature(type(attention).forward).parameters.values())[1:]  # after self
    if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise AttentionSiteError(f"{type(attention).__name__}.forward names no input (its signature: "
                                 f"{inspect.signature(type(attention).forward)})")  # fmt: skip
    return parameters[0].name


def _head_dim(model: nn.Module, attention: nn.Module, width: int) -> int:
    """The head size of the output projection's input: the value heads' (`v_head_dim`: latent attention's
    `head_dim` is its rotary part's), else the attention's own `head_dim`, else its config's, else the width over
    its heads."""
    config = text_config(model.config)
    heads = getattr(attention, "num_heads", None) or getattr(config, "num_attention_heads", None)
    for head_dim in (getattr(attention, "v_head_dim", None), config.__dict__.get("v_head_dim"),
                     getattr(attention, "head_dim", None), config.__dict__.get("head_dim"),
                     width // heads if isinstance(heads, int) and heads and width % heads == 0 else None):  # fmt: skip
        if isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0:
            return head_dim
    raise AttentionSiteError(f"{type(attention).__name__}: its output projection's input ({width} wide) splits into "
                             f"no whole number of heads (head_dim {getattr(attention, 'head_dim', None)}, heads {heads})")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The declared softmax-attention modules of `model`'s text model, each once, with its name in `model`."""
    prefix, text = text_model(model)
    attentions = declaration(model).get("attentions")
    if not attentions:
        raise AttentionSiteError(
            f"{source_name(model)} declares no attention modules (transformers' `_can_record_outputs` names none)"
        )
    found = [(f"{prefix}.{name}".strip("."), module) for name, module in declared_modules(text, declared_by(attentions))]
    softmax = [(name, module) for name, module in found if is_softmax(module)]
    if not softmax:
        what = ", ".join(sorted({f"{type(m).__name__} ({NOT_SOFTMAX[type(m).__name__]})" for _, m in found}))
        raise AttentionSiteError(f"{source_name(model)} has no softmax attention to gate" + (f": {what}" if what else ""))
    return softmax


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every softmax-attention module of `model` (see the module docstring), or `AttentionSiteError` in one line."""
    plan = _plan_patterns(model)
    sites = []
    for path, attention in attention_modules(model):
        if hasattr(attention, "attn_gate"):
            raise AttentionSiteError(f"{type(attention).__name__} has an attribute attn_gate already")
        config = text_config(model.config)
        hidden = getattr(config, "hidden_size", None)
        output, plan_key = _output_projection(path, attention, hidden, plan)
        projection = getattr(attention, output)
        widths = _linear_widths(projection)
        if widths is None:
            raise AttentionSiteError(f"{type(attention).__name__}'s output projection {output} is a "
                                     f"{type(projection).__name__}, not one linear map (nn.Linear)")  # fmt: skip
        # The attention's input feeds its other projections (q/k/v, a fused qkv): as wide as their inputs.
        inputs = [w[0] for name, child in attention.named_children() if name != output and (w := _linear_widths(child))]
        in_features = inputs[0] if inputs else hidden
        if not isinstance(in_features, int):
            raise AttentionSiteError(f"{type(attention).__name__}: the width of its input is not known (no linear "
                                     "projection reads it, and its config has no hidden_size)")  # fmt: skip
        sites.append(AttentionSite(path, attention, output, _input_name(attention), in_features, widths[0],
                                   _head_dim(model, attention, widths[0]), plan_key, _latent(model, attention)))  # fmt: skip
    return sites
