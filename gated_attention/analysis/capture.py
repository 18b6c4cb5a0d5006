"""Hooks that record a causal LM's residual stream, attention maps and gate scores.

Index convention (docs/architecture.md, "Metric definitions"): residual position l = 0..L. `X[0]` is the input
of decoder layer 1 (the embedding output), `X[l]` the output of decoder layer
l (1-based; HF `layer_idx = l - 1`). `X[L]` is taken *before* the final norm,
whereas transformers' `hidden_states[-1]` is after it. Full-attention layers
are 1-based too.

Which layers are attention layers: `config.layer_types` when present
("full_attention" and "sliding_attention" count, "linear_attention" does not),
fla's `config.attn["layers"]` (0-based) for fla hybrids, else every layer.

Attention maps come from the model's own eager attention path: while a
`Capture` with `attentions=True` is open, the model runs with
`attn_implementation="eager"` (restored on exit) and the hook keeps the
weights each attention module returns. Recomputing them from captured q/k
instead would need every family's RoPE, q/k-norm and GQA details; the eager
path is the model's own arithmetic, for every family at once. fla's attention
layers (flash-attn only) return no weights: their maps are missing, with a
warning.

transformers' Qwen3-Next / Qwen3.5 / OLMo-hybrid call fla's gated-delta-rule
kernels whenever fla imports, which fails on CPU tensors. On CPU,
`torch_linear_attention` points those layers at transformers' own torch
implementation for as long as it is open (a module-level patch, restored on
exit; logged once).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_ATTENTION_CHILD_NAMES = ("self_attn", "attn", "attention", "self_attention")
# transformers' torch fallbacks of the gated delta rule (module-level since 5.x) and the
# per-layer attributes older releases stored the chosen kernel in.
_TORCH_DELTA_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_LAYER_DELTA_RULE_ATTRS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
}


# ---------------------------------------------------------------- model layout


@dataclass
class GateSite:
    """Where a layer's attention gate scores come from.

    kind "attn_gate": our `self_attn.attn_gate`, whose forward returns the
    gate's logits flat and whose `gate_scores` activates them and gives them heads. kind "q_proj": transformers' Qwen3-Next/Qwen3.5 output
    gate, the second half of each head's q_proj output, `sigmoid`-ed.
    """

    kind: str
    module: nn.Module
    num_heads: int = 0
    head_dim: int = 0


@dataclass
class ModelLayout:
    layers: nn.ModuleList
    layer_types: list[str]
    full_attention_layers: list[int]  # 1-based
    attention_modules: dict[int, nn.Module]  # 1-based attention layer -> its attention module
    gates: dict[int, GateSite]  # 1-based attention layer -> gate site

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _decoder_layers(model: nn.Module, num_layers: int | None) -> nn.ModuleList:
    """The ModuleList of decoder layers: named `layers` (else `h`/`blocks`), of the config's length, shallowest."""
    candidates = [
        (name.rsplit(".", 1)[-1] != "layers", name.count("."), name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")
        and (num_layers is None or len(module) == num_layers)
    ]
    if not candidates:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no ModuleList named 'layers')")
    return min(candidates, key=lambda c: c[:3])[3]


def layer_types_of(config, num_layers: int) -> list[str]:
    """Each decoder layer's type, `"full_attention"` or another, from `config.layer_types` or fla's `config.attn`."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    attn = getattr(config, "attn", "absent")
    if attn is None or isinstance(attn, dict):
        # fla hybrids: config.attn = {"layers": [0-based indices], ...}, None for a pure linear model.
        attention = set((attn or {}).get("layers", []))
        return ["full_attention" if i in attention else "linear_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def _gate_site(config, attention: nn.Module) -> GateSite | None:
    gate = getattr(attention, "attn_gate", None)
    if isinstance(gate, nn.Module):
        return GateSite("attn_gate", gate)
    q_proj, head_dim = getattr(attention, "q_proj", None), getattr(attention, "head_dim", None)
    num_heads = getattr(config, "num_attention_heads", None)
    if isinstance(q_proj, nn.Linear) and head_dim and num_heads and q_proj.out_features == 2 * num_heads * head_dim:
        return GateSite("q_proj", q_proj, num_heads, head_dim)
    return None


def model_layout(model: nn.Module) -> ModelLayout:
    """Decoder layers, attention layers (1-based), their attention modules and gate sites."""
    config = _text_config(model)
    num_layers = getattr(config, "num_hidden_layers", None)
    layers = _decoder_layers(model, num_layers)
    types = layer_types_of(config, len(layers))
    if len(types) != len(layers):
        raise ValueError(f"config.layer_types has {len(types)} entries for {len(layers)} layers")
    full = [i + 1 for i, t in enumerate(types) if t in ATTENTION_LAYER_TYPES]
    attention_modules, gates = {}, {}
    for f in full:
        layer = layers[f - 1]
        attention = next((getattr(layer, n) for n in _ATTENTION_CHILD_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
        if attention is None:
            continue
        attention_modules[f] = attention
        if (site := _gate_site(config, attention)) is not None:
            gates[f] = site
    return ModelLayout(layers, types, full, attention_modules, gates)


# ---------------------------------------------------------------- small context managers


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Run `model` with `attn_implementation="eager"` (attention modules then return their weights)."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous in (None, "eager"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def torch_linear_attention(model: nn.Module) -> Iterator[None]:
    """On CPU, make transformers' gated-delta-rule layers call their torch implementations.

    transformers wraps `torch_chunk_gated_delta_rule` (and the recurrent one)
    so that they dispatch to fla whenever fla imports, and fla's Triton kernels
    fail on CPU tensors ("0 active drivers"). The unwrapped function is
    transformers' own torch reference. No-op off CPU.
    """
    if _model_device(model).type != "cpu":
        yield
        return
    restore: list[Callable[[], None]] = []
    seen: set[int] = set()
    try:
        for module in model.modules():
            source = sys.modules.get(type(module).__module__)
            if source is not None and id(source) not in seen:
                seen.add(id(source))
                for name in _TORCH_DELTA_RULES:
                    fn = getattr(source, name, None)
                    if callable(fn) and (plain := inspect.unwrap(fn)) is not fn:
                        setattr(source, name, plain)
                        restore.append(lambda s=source, n=name, f=fn: setattr(s, n, f))
            for attr, torch_name in _LAYER_DELTA_RULE_ATTRS.items():
                plain = getattr(source, torch_name, None) if source is not None else None
                if attr in vars(module) and plain is not None and vars(module)[attr] is not plain:
                    old = vars(module)[attr]
                    setattr(module, attr, inspect.unwrap(plain))
                    restore.append(lambda m=module, a=attr, f=old: setattr(m, a, f))
        if restore:
            logger.warning_once("Model on CPU: running gated-delta-rule layers with transformers' torch implementation.")
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _hidden_argument(module: nn.Module, args: tuple, kwargs: dict) -> tuple[inspect.BoundArguments, str]:
    """Bind a layer call to its signature; the residual is `hidden_states` or the first parameter."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    if "hidden_states" in bound.arguments:
        return bound, "hidden_states"
    return bound, next(iter(bound.arguments))


ResidualFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]


@contextlib.contextmanager
def residual_hooks(layers: nn.ModuleList, fn: ResidualFn) -> Iterator[None]:
    """Call `fn(l, X[l])` for every residual state of each forward, l = 0..L.

    X[0] is read from decoder layer 1's input by a `with_kwargs` pre-hook (the
    argument is found by name, never by position), X[l] from layer l's output.
    A tensor returned by `fn` replaces the state the model continues with.
    Hooks are removed on exit, also when the body raises.
    """

    def pre_hook(module, args, kwargs):
        bound, name = _hidden_argument(module, args, kwargs)
        new = fn(0, bound.arguments[name])
        if new is None:
            return None
        bound.arguments[name] = new
        return bound.args, bound.kwargs

    def make_post_hook(l: int):
        def post_hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            new = fn(l, hidden)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return post_hook

    handles = []
    try:
        handles.append(layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for l, layer in enumerate(layers, start=1):
            handles.append(layer.register_forward_hook(make_post_hook(l)))
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------- capture


@dataclass
class Record:
    """What one forward call computed; tensors are detached references (model dtype and device).

    residual: X[0..L], each `[B, T, D]`. attentions: 1-based attention layer ->
    `[B, H, T, T]` (rows = queries). gates: 1-based attention layer -> scores,
    `[B, T, H, W]` (W = head_dim elementwise, 1 headwise) or `[B, T, D]` (dense G5).
    """

    residual: list[torch.Tensor] = field(default_factory=list)
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)
    gates: dict[int, torch.Tensor] = field(default_factory=dict)

    def residual_stack(self) -> torch.Tensor:
        """`[L+1, B, T, D]`."""
        return torch.stack(self.residual)


class Capture:
    """Context manager that records every forward of `model`, one `Record` per call.

    ```python
    with Capture(model) as cap:
        model(input_ids)
    record = cap.records[-1]           # residual X[0..L], attention maps, gate scores
    cap.layout.full_attention_layers   # 1-based
    ```

    `attentions=True` runs the model with eager attention while open. On CPU,
    transformers' gated-delta-rule layers use their torch path while open.
    All hooks and switches are undone on exit, also after an exception.
    """

    def __init__(self, model: nn.Module, *, residual: bool = True, attentions: bool = True, gates: bool = True):
        self.model = model
        self.want_residual, self.want_attentions, self.want_gates = residual, attentions, gates
        self.layout = model_layout(model)
        self.records: list[Record] = []
        self._stack: contextlib.ExitStack | None = None

    def clear(self) -> None:
        self.records.clear()

    # hooks -----------------------------------------------------------
    def _on_residual(self, l: int, x: torch.Tensor) -> None:
        if l == 0:  # layer 1's input: a new forward call starts
            self.records.append(Record())
        if self.want_residual:
            self.records[-1].residual.append(x.detach())

    def _attention_hook(self, f: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if isinstance(weights, torch.Tensor) and weights.dim() == 4:
                self.records[-1].attentions[f] = weights.detach()
            else:
                logger.warning_once(
                    f"{type(module).__name__} returned no attention weights: its attention maps are not captured."
                )

        return hook

    def _gate_hook(self, f: int, site: GateSite):
        def hook(module, args, output):
            if site.kind == "attn_gate":
                scores = module.gate_scores.to_heads(module.gate_scores(output))  # [B, T, H, D or 1]; G5 [B, T, hidden]
            else:  # q_proj -> [B, T, H, 2 * head_dim]: query, then gate logits, per head
                scores = torch.sigmoid(output.view(*output.shape[:-1], site.num_heads, 2 * site.head_dim)[..., site.head_dim :])
            self.records[-1].gates[f] = scores.detach()

        return hook

    # context ---------------------------------------------------------
    def __enter__(self) -> Capture:
        stack = contextlib.ExitStack()
        try:
            if self.want_attentions:
                stack.enter_context(eager_attention(self.model))
            stack.enter_context(torch_linear_attention(self.model))
            # The residual hook opens each Record, so it is always installed.
            stack.enter_context(residual_hooks(self.layout.layers, self._on_residual))
            if self.want_attentions:
                for f, module in self.layout.attention_modules.items():
                    stack.callback(module.register_forward_hook(self._attention_hook(f)).remove)
            if self.want_gates:
                for f, site in self.layout.gates.items():
                    stack.callback(site.module.register_forward_hook(self._gate_hook(f, site)).remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc_info) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
