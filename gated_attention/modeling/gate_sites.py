"""Where an attention module's output gate is, for every kind of gate the package reads: one rule, which the
analysis (`analysis/layout.py`, the gate scores it captures) and the quantization (`quantization/`, the gates it
keeps or rounds) both ask.

- our `self_attn.attn_gate` (every family and gate variant, and transformers' models gated by declaration);
- `OUTPUT_GATES`: the attention output gates transformers ships, a linear map of their own;
- Qwen3-Next's, Qwen3.5's and Qwen4-Exp's gate, the second half of each head's rows of `q_proj` (MiniCPM5-MoE's
  `q_gate_proj`), found by its width (`FUSED_QUERY_GATES`);
- a learned sink logit per head (our `attention_sinks`, GPT-OSS's `sinks`), which acts as a headwise gate the
  attention computes itself, where no gate module is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..configuration.declared import text_config
from .recorded_outputs import declaration, declared_modules, softmax_attention

# Attention output gates transformers ships, which no declaration names: attention class -> the gate's linear map
# (named under the attention module as the model names its parameters; where releases put it in different places,
# each name in turn, the first the model has) and the activation the model applies to its output, `[B, T, H]` (a score
# per head) or `[B, T, H * W]`. Qwen3-Next's gate, half of q_proj, is found by its width (`FUSED_QUERY_GATES`). Inkling2's gate
# sits in its output projection (`Inkling2GatedOutputProjection`) in transformers 5.24 and later, on the attention in
# 5.23: the same map of the same input, applied to the same output.
INKLING2_GATE = ("o_proj.gate_proj", "gate_proj")
OUTPUT_GATES = {
    "Lfm3Attention": ("g_proj", "sigmoid"),
    "BailingHybridAttention": ("g_proj", "sigmoid"),
    "LagunaAttention": ("g_proj", "softplus"),
    "Dots3NoteTextAttention": ("g_proj", "sigmoid"),
    "HYV4Attention": ("gate_proj", "sigmoid"),
    "AfmoeAttention": ("gate_proj", "sigmoid"),
    "HrmTextAttention": ("gate_proj", "sigmoid"),
    "MuseGlimmerTextAttention": ("gate_proj", "sigmoid"),
    "MuseSparkTextAttention": ("gate_proj", "sigmoid"),  # on the output of its o_norm, before o_proj
    "Step3p7Attention": ("g_proj", "sigmoid"),
    "Inkling2SlidingAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2FullAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2LoopSlidingAttention": (INKLING2_GATE, "sigmoid"),
    "Inkling2LoopFullAttention": (INKLING2_GATE, "sigmoid"),
}
# The projections a gate is fused into, each head's rows its query then its gate (`2 * head_dim`), by name under the
# attention module: Qwen3-Next's, Qwen3.5's and Qwen4-Exp's `q_proj`, MiniCPM5-MoE's `q_gate_proj`.
FUSED_QUERY_GATES = ("q_proj", "q_gate_proj")
# Output gates transformers ships that are not `activation(linear(attention input))`, so that `analyze` reads no
# scores for them (it reads such a model as it reads an ungated one: maps, residuals, no gate columns) and `convert`
# still refuses a second gate on them (`unread_gate`): attention class -> the gate's module and what it computes.
UNREAD_OUTPUT_GATES = {
    "BeamAttention": ("gate_proj", "sigmoid(gate_proj(x) + a bias per head, gate_bias)"),
    "DoryAttention": ("gate_proj", "sigmoid(gate_proj(x) * (s_gate * s_gate_scale)^2)"),
    "AXK2Attention": ("q_gate_proj", "sigmoid of each head's last v_head_dim rows, fed by the latent query"),
}


@dataclass
class GateSite:
    """Where an attention module's gate scores come from.

    kind "attn_gate": our `self_attn.attn_gate`, whose forward returns the gate's logits flat and whose
    `gate_scores` activates them and gives them heads. kind "q_proj": transformers' Qwen3-Next/Qwen3.5
    output gate, the second half of each head's output of a `FUSED_QUERY_GATES` projection, `sigmoid`-ed.
    kind "projection": a linear map of `OUTPUT_GATES` whose output, `activation`-ed, is the gate (`[B, T, H]`
    or `[B, T, H * W]`).
    kind "sinks": no gate module but a learned sink logit per head (our `attention_sinks`, GPT-OSS's
    `sinks`): the attention module itself, whose weights leave the sink its share of each row; the score is
    what the keys keep, `sigmoid(lse - s_h)`, a headwise gate the attention computes itself.
    `name`: the gate's module under the attention module (the analysis prefixes the path under the decoder
    layer), as the model names its parameters.
    """

    kind: str
    module: nn.Module
    num_heads: int = 0
    head_dim: int = 0
    activation: str = "sigmoid"
    name: str = ""

    def describe(self) -> str:
        """The gate in a few words, as a refusal names it."""
        if self.kind == "q_proj":
            return f"sigmoid output gate, the second half of each head's {self.name} rows"
        if self.kind == "projection":
            return f"{self.activation} output gate {self.name}"
        return {"attn_gate": "output gate attn_gate", "sinks": "learned sink logits"}[self.kind]

    def linears(self) -> Iterator[tuple[nn.Linear, torch.Tensor | None]]:
        """The linear maps that hold the gate's weights, each with the boolean mask of its output rows that are the
        gate's (`[out_features]`), or None where every row is: a fused `q_proj`'s gate rows are the second half of
        each head's `2 * head_dim`. An input-independent gate (a parameter) and learned sinks hold none."""
        if self.kind == "attn_gate":
            yield from ((m, None) for m in self.module.modules() if isinstance(m, nn.Linear))
        elif self.kind == "projection":
            yield self.module, None
        elif self.kind == "q_proj":
            rows = torch.zeros(self.num_heads, 2, self.head_dim, dtype=torch.bool)
            rows[:, 1] = True  # [H, (query, gate), D]: query first, then the gate's logits, per head
            yield self.module, rows.flatten()


def gate_site(config, attention: nn.Module) -> GateSite | None:
    """The gate of one softmax-attention module, or None where it has none."""
    gate = getattr(attention, "attn_gate", None)
    if isinstance(gate, nn.Module):
        return GateSite("attn_gate", gate, name="attn_gate")
    return source_gate(config, attention)


def source_gate(config, attention: nn.Module) -> GateSite | None:
    """The gate an attention module's own model gives it (transformers' code, not this package's `attn_gate`), or
    None: a model that gates its attention output already, which `convert` refuses to gate a second time."""
    head_dim = getattr(attention, "head_dim", None)
    num_heads = getattr(attention, "num_heads", None) or getattr(config, "num_attention_heads", None)
    if (record := OUTPUT_GATES.get(type(attention).__name__)) is not None:
        names, activation = record
        name = next((n for n in ((names,) if isinstance(names, str) else names) if _has_submodule(attention, n)), None)
        projection = attention.get_submodule(name) if name else None
        if isinstance(projection, nn.Linear) and num_heads and projection.out_features % num_heads == 0:
            return GateSite("projection", projection, num_heads, projection.out_features // num_heads, activation, name)
        return None  # the model was built without its gate (Lfm3's `use_attention_gate=False`)
    if type(attention).__name__ in UNREAD_OUTPUT_GATES:  # a gate not read as scores (AXK2's fused rows are no halves)
        return None
    for name in FUSED_QUERY_GATES:
        fused = getattr(attention, name, None)
        if isinstance(fused, nn.Linear) and head_dim and num_heads and fused.out_features == 2 * num_heads * head_dim:
            return GateSite("q_proj", fused, num_heads, head_dim, name=name)
    sinks = getattr(attention, "sinks", None)
    if isinstance(sinks, nn.Parameter) and sinks.dim() == 1:  # only where no gate module is: that one is the gate
        return GateSite("sinks", attention, sinks.numel(), 1, name="sinks")
    return None


def unread_gate(attention: nn.Module) -> str | None:
    """An `UNREAD_OUTPUT_GATES` gate of the attention module, in a few words as a refusal names it, or None."""
    record = UNREAD_OUTPUT_GATES.get(type(attention).__name__)
    if record is None or not _has_submodule(attention, record[0]):
        return None
    return f"output gate {record[0]}, {record[1]}"


def gate_sites(model: nn.Module) -> dict[str, GateSite]:
    """Every declared softmax-attention module's gate, by the attention's path in `model`, in the order the model
    holds them (a module several layers share, once)."""
    config = text_config(model.config)
    is_attention = softmax_attention(declaration(model).get("attentions", []))
    sites = {}
    for path, attention in declared_modules(model, is_attention):
        if (site := gate_site(config, attention)) is not None:
            sites[path] = site
    return sites


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False
