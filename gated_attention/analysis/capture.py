"""Hooks that record a causal LM's residual stream, attention maps and gate scores.

Index convention (docs/architecture.md, "Metric definitions"): residual position l = 0..L. `X[0]` is the input
of decoder layer 1 (the embedding output), `X[l]` the output of decoder layer
l (1-based; HF `layer_idx = l - 1`). `X[L]` is taken *before* the final norm,
whereas transformers' `hidden_states[-1]` is after it. Attention layers are 1-based too.

Which modules are decoder layers, attention and gates: `layout.model_layout`, from the model's own
`_can_record_outputs` declaration. Every call of an attention module is attributed to the decoder
layer running at that moment, so a module shared by several layers (Zamba's attention block)
records once per calling layer.

Attention maps come from the model's own eager attention path: while a
`Capture` with `attentions=True` is open, the model runs with
`attn_implementation="eager"` (restored on exit) and the hook keeps the
weights each attention module returns, as transformers' `output_attentions`
does. Recomputing them from captured q/k instead would need every family's
RoPE, q/k-norm and GQA details; the eager path is the model's own arithmetic,
for every family at once. A legacy class (`recorded_outputs.LEGACY_DECLARATIONS`) computes
its weights only when asked: the model is then called with `output_attentions=True`
while the capture is open. An attention layer that returns no weights, or does
not run, is a `CaptureError` naming the model class and the layer: never a
missing map that later metrics would silently skip.

`reduce=True` keeps, per forward, only what the analysis tables need, reduced
inside the hooks as each layer runs: the largest |X[l]| of every token, each
attention layer's attention on the first token per head (over the queries after
it, and over all queries) and the attention each token receives from later
queries, and the gate scores' sums and histogram. Memory
then grows with one layer's attention map, not with the number of layers.

transformers' Qwen3-Next / Qwen3.5 / OLMo-hybrid / Kimi Linear call fla's
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

import numpy as np
import torch
from torch import nn
from transformers.utils import logging

from ..fla_cpu import fla_torch_paths
from .metrics import gate_summary, scores_per_head
from ..modeling.gate_sites import GateSite
from .layout import ModelLayout, model_layout

logger = logging.get_logger(__name__)

# transformers' torch implementations that sit behind wrappers dispatching to fla whenever fla imports
# (module-level functions), and the per-layer attributes some releases store the chosen kernel in.
FLA_WRAPPED_TORCH_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
)
_LAYER_DELTA_RULE_ATTRS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
}


# The activations of `modeling.gate_sites.OUTPUT_GATES`.
GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softplus": torch.nn.functional.softplus}


class CaptureError(ValueError):
    """What a model gave cannot be captured as asked; the message is one line for the user."""


# ---------------------------------------------------------------- small context managers


def execution_devices(model: nn.Module) -> set[torch.device]:
    """The devices `model`'s modules compute on. Under accelerate's big-model dispatch a module's weights
    may wait on the meta device (offloaded to CPU memory or disk) and its hook names where it runs."""
    devices = set()
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            devices.add(torch.device(device if not isinstance(device, int) else f"cuda:{device}"))
        devices.update(p.device for p in module.parameters(recurse=False) if p.device.type != "meta")
    return devices or {torch.device("cpu")}


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Run `model` with `attn_implementation="eager"` (attention modules then return their weights).

    A composite model's submodels keep their own setting (GOT-OCR2's text model stays "sdpa" when the
    whole is set): each submodel that is not eager afterwards is set too. On exit each submodel gets its own
    setting back, never the whole's: transformers gives a setting asked of a model to every submodel below it, and a
    tower that runs only eager attention (Gemma 4's audio tower) refuses the text model's "sdpa".
    """
    from transformers import PreTrainedModel

    # A class that does not call attention through transformers' interface cannot switch (`_can_set_attn_implementation`
    # false: it picks its weight-returning path itself when asked, `weights_requested`); asking would only warn.
    subs = [m for m in model.modules() if isinstance(m, PreTrainedModel) and _can_switch_attention(m)]
    before = {id(config): getattr(config, "_attn_implementation", None) for config in _configs(subs)}
    if all(setting in (None, "eager") for setting in before.values()):
        yield
        return
    for m in subs:
        if getattr(m.config, "_attn_implementation", None) not in (None, "eager"):
            m.set_attn_implementation("eager")
    try:
        yield
    finally:
        for m in subs:  # outer models first: each call sets its submodels, and an inner one then sets its own
            if any(before[id(c)] not in (None, getattr(c, "_attn_implementation", None)) for c in _configs([m])):
                m.set_attn_implementation(_own_settings(m.config, before))


def _configs(models: list[nn.Module]) -> list:
    """The configs of `models` and every sub-config under them (a tower's), each once."""
    found, todo = {}, [m.config for m in models]
    while todo:
        config = todo.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        todo += [sub for key in getattr(config, "sub_configs", {}) if (sub := getattr(config, key, None)) is not None]
    return list(found.values())


def _own_settings(config, settings: dict[int, str | None]) -> dict[str, str]:
    """transformers' per-sub-config form of `set_attn_implementation` ("" for the model itself, each sub-config by its
    key), with each config's own setting from `settings` (id of a config -> its setting). A config that had none
    (a tower that is no `PreTrainedModel` of its own, whose config transformers never resolved) cannot be given None
    back: it is left out, and keeps "eager", what transformers' attention interface runs for None too."""
    own = {"": settings[id(config)]}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None and id(sub) in settings:
            own[key] = settings[id(sub)]
    return {key: setting for key, setting in own.items() if setting is not None}


def _can_switch_attention(model: nn.Module) -> bool:
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return can_set is None or can_set()


@contextlib.contextmanager
def weights_requested(model: nn.Module) -> Iterator[None]:
    """Call `model` with `output_attentions=True`: a legacy attention class (`recorded_outputs.LEGACY_DECLARATIONS`) computes
    its weights only when asked. The model then also returns every layer's map, as transformers' own flag does."""

    def pre_hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        bound.arguments["output_attentions"] = True
        return bound.args, bound.kwargs

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def torch_linear_attention(model: nn.Module) -> Iterator[None]:
    """On CPU, make transformers' gated-delta-rule and KDA layers call their torch implementations.

    transformers wraps `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`
    (and their recurrent twins) so that they dispatch to fla whenever fla
    imports, and fla's Triton kernels fail on CPU tensors ("0 active drivers").
    The unwrapped function is transformers' own torch reference; this happens only where a module
    runs on the CPU. fla's own layers (its models and fla hybrids) go through `fla_cpu.fla_torch_paths`,
    which chooses by each call's tensors and makes fla's attention return its weights.
    """
    with fla_torch_paths():  # fla's own models and layers: by each tensor's device (a no-op where fla is not imported)
        if all(device.type != "cpu" for device in execution_devices(model)):
            yield
        else:
            with _transformers_torch_paths(model):
                yield


@contextlib.contextmanager
def _transformers_torch_paths(model: nn.Module) -> Iterator[None]:
    restore: list[Callable[[], None]] = []
    seen: set[int] = set()
    try:
        for module in model.modules():
            source = sys.modules.get(type(module).__module__)
            if source is not None and id(source) not in seen:
                seen.add(id(source))
                for name in FLA_WRAPPED_TORCH_FUNCTIONS:
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
            logger.warning_once("Model on CPU: running linear-attention layers with transformers' torch implementation.")
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
def residual_hooks(layout: ModelLayout, fn: ResidualFn) -> Iterator[None]:
    """Call `fn(layer, X[layer])` for every residual state of each forward, layer = 0..L, X `[B, T, D]`.

    `layout.layers` are the decoder-layer calls in the order the model makes them: a module that runs several times in
    one forward (a loop) is listed once per call, and X[layer] is the output of that call. X[0] is read from the input
    of the first call's entry (`layout.entries`: the layer, or the module that starts it) by a `with_kwargs` pre-hook
    (the argument is found by name, never by position); a later pass of that module is no new forward. Each state is
    given to `fn` through the layout's view (`model_records.View.residual`: as transformers returns it), and a tensor
    `fn` returns replaces the state the model continues with (`View.edited`: turned back into the model's layout).
    Hooks are removed on exit, also when the body raises.
    """
    layers, entries, view = layout.layers, layout.entries, layout.view
    done = 0  # decoder-layer calls so far in this forward

    def call(layer: int, x: torch.Tensor) -> torch.Tensor | None:
        new = fn(layer, view.residual(x))
        return None if new is None else view.edited(x, new)

    def pre_hook(module, args, kwargs):
        nonlocal done
        if 0 < done < len(entries) and entries[done] is module:  # a later pass of the first layer, in the same forward
            return None
        done = 0
        bound, name = _hidden_argument(module, args, kwargs)
        new = call(0, bound.arguments[name])
        if new is None:
            return None
        bound.arguments[name] = new
        return bound.args, bound.kwargs

    def post_hook(module, args, output):
        nonlocal done
        done += 1
        several = isinstance(output, (tuple, list))  # (hidden, weights, ...); a list in OpenAI GPT's blocks
        new = call(done, output[0] if several else output)
        if new is None:
            return None
        return type(output)([new, *output[1:]]) if several else new

    handles = []
    try:
        handles.append(entries[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for module in {id(module): module for module in layers}.values():
            handles.append(module.register_forward_hook(post_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------- capture


@dataclass
class Record:
    """What one forward call computed; tensors are detached (model dtype and device unless said).

    Raw (`reduce=False`): residual: X[0..L], each `[B, T, D]`. attentions: 1-based attention
    layer -> `[B, H, T, T]` (rows = queries) of its first attention block; later_attentions: (layer, b) -> the map of
    block b >= 2 of a layer that holds several (`ModelLayout.later_blocks`; `attention_map` reads either). gates:
    1-based attention layer -> scores, `[B, T, H, W]` (W = head_dim elementwise, 1 headwise) or `[B, T, D]` (dense G5).

    Reduced (`reduce=True`), every attention block keyed by (layer, b), b = 1 for a layer's first block:
    token_max: `max_j |X[l][b, t, j]|` for l = 0..L, each `[B, T]` float32. first_token_attention: `[B, H]` float64,
    the mean attention on token 0 over queries q >= 1. first_token_importance: `[B, H]` float64, the mean attention on
    token 0 over all queries (`metrics.first_token_importance`). received: `[B, T]` float64, the attention each token
    receives from later queries, summed over them and averaged over heads (`metrics.received_attention`).
    gate_summaries: layer -> `metrics.gate_summary` of its scores.
    """

    residual: list[torch.Tensor] = field(default_factory=list)
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)
    later_attentions: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    gates: dict[int, torch.Tensor] = field(default_factory=dict)
    token_max: list[torch.Tensor] = field(default_factory=list)
    first_token_attention: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    first_token_importance: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    gate_summaries: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def attention_map(self, layer: int, b: int) -> torch.Tensor:
        """The map of attention block b (1-based) of `layer`, `[B, H, T, T]`."""
        return self.attentions[layer] if b == 1 else self.later_attentions[(layer, b)]

    def blocks(self) -> set[tuple[int, int]]:
        """The (layer, block) of every attention block read so far."""
        return {(layer, 1) for layer in self.attentions} | set(self.later_attentions) | set(self.received)

    def residual_stack(self) -> torch.Tensor:
        """`[L+1, B, T, D]`."""
        return torch.stack(self.residual)


def first_token_attention_of(weights: torch.Tensor) -> torch.Tensor:
    """`metrics.first_token_attention` on a batch of maps: `[B, H, T, T]` -> `[B, H]` float64 (NaN when T < 2)."""
    if weights.shape[-1] < 2:
        return torch.full(weights.shape[:2], float("nan"), dtype=torch.float64, device=weights.device)
    return weights[:, :, 1:, 0].double().mean(-1)


def first_token_importance_of(weights: torch.Tensor) -> torch.Tensor:
    """`metrics.first_token_importance` on a batch of maps: `[B, H, T, T]` -> `[B, H]` float64."""
    return weights[:, :, :, 0].double().mean(-1)


def received_attention_of(weights: torch.Tensor) -> torch.Tensor:
    """`metrics.received_attention` on a batch of maps: `[B, H, T, T]` -> `[B, T]` float64.

    The sum runs in float64 over the map as the model computed it; `tril` copies one map in its dtype. Keys past
    the T tokens (DeepSeek-V4 appends its compressed blocks after them: `[B, H, T, T + blocks]`) are no token's.
    """
    return weights[..., : weights.shape[-2]].tril(-1).sum(-2, dtype=torch.float64).mean(1)


def gate_scores(site: GateSite, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """The gate's scores from its module's output: `[B, T, H, D or 1]`, or `[B, T, hidden]` for G5."""
    if site.kind == "attn_gate":
        return module.gate_scores.to_heads(module.gate_scores(output))
    if site.kind == "sinks":  # the attention's (output, weights): what the T keys keep of each row, [B, T, H, 1]
        weights = output[1]
        if weights is None:
            raise CaptureError(f"{type(module).__name__} returned no attention weights: its sinks' share is read "
                               "from them (capture with attentions)")
        return weights[..., : weights.shape[-2]].sum(-1, dtype=torch.float32).transpose(1, 2)[..., None]
    if site.kind == "projection":  # [B, T, H * W] -> [B, T, H, W], activated as the model does, in float32
        scores = GATE_ACTIVATIONS[site.activation](output.float())
        return scores.view(*scores.shape[:-1], site.num_heads, site.head_dim)
    # q_proj -> [B, T, H, 2 * head_dim]: query, then gate logits, per head
    return torch.sigmoid(output.view(*output.shape[:-1], site.num_heads, 2 * site.head_dim)[..., site.head_dim :])


class Capture:
    """Context manager that records every forward of `model`, one `Record` per call.

    ```python
    with Capture(model) as cap:
        model(input_ids)
    record = cap.records[-1]           # residual X[0..L], attention maps, gate scores
    cap.layout.attention_layers        # 1-based
    ```

    `attentions=True` runs the model with eager attention while open. On CPU,
    transformers' gated-delta-rule and KDA layers use their torch path while open.
    `reduce=True` keeps reduced statistics instead of tensors (see `Record`).
    All hooks and switches are undone on exit, also after an exception.
    """

    def __init__(
        self, model: nn.Module, *, residual: bool = True, attentions: bool = True, gates: bool = True, reduce: bool = False,
        layout: ModelLayout | None = None,
    ):
        self.model = model
        self.want_residual, self.want_attentions, self.want_gates = residual, attentions, gates
        self.reduce = reduce
        self.layout = layout or model_layout(model)  # given: the caller's, read once (a loop's costs a forward)
        self.records: list[Record] = []
        self._layer: int | None = None  # the decoder layer running now (1-based)
        self._next = 0
        self._in_forward = False
        self._stack: contextlib.ExitStack | None = None
        # The last residual state read, not yet reduced: (its record, the state). See `_reduce_pending`.
        self._pending: tuple[Record, torch.Tensor] | None = None

    def clear(self) -> None:
        self.records.clear()

    def _where(self, layer: int | None) -> str:
        return f"{type(self.model).__name__} layer {layer}" if layer is not None else f"{type(self.model).__name__}"

    # hooks -----------------------------------------------------------
    def _on_forward(self, module, args) -> None:
        self.records.append(Record())
        self._next = 0  # the residual state the next decoder-layer hook must give: X[_next]
        self._in_forward = True

    def _reduce_pending(self, *_) -> None:
        """Reduce the last residual state read. A model may change a layer's output in place after the layer returns
        it (XLM multiplies it by its padding mask), and transformers returns the changed tensor: a state is therefore
        reduced when the next layer starts or the forward that made it returns, not when its layer returns."""
        if self._pending is not None:
            record, x = self._pending
            self._pending = None
            record.token_max.append(x.abs().amax(-1).float())

    def _on_forward_end(self, module, args, output) -> None:
        self._reduce_pending()
        self._in_forward = False
        if self._next <= self.layout.num_layers:  # a layer the model skipped (Mllama's cross-attention without an image)
            raise CaptureError(
                f"{self._where(max(self._next, 1))}: the decoder layer did not run in this forward, so it has no output"
            )

    def _on_residual(self, layer: int, x: torch.Tensor) -> None:
        """X[layer] `[B, T, D]`, as the layout's view reads it."""
        self._reduce_pending()
        if layer == 0 and not self._in_forward:  # the caller ran the decoder without `self.model` (its base model, say)
            self.records.append(Record())
            self._next = 0
        # Each state once per forward, in order: a layer that runs again where the layout lists no second call would
        # otherwise replace the first pass's numbers with the last's.
        if layer != self._next:
            raise CaptureError(
                f"{self._where(max(layer, 1))} ran {'again' if layer < self._next else 'out of order'} in one forward "
                f"(the model runs its layers in a loop), which its layout does not list"
            )
        self._next += 1
        record = self.records[-1]
        if x.dim() != 3:  # several streams that the model reduces without a module of its own (Gemma 3n's AltUp)
            raise CaptureError(
                f"{self._where(max(layer, 1))}: its residual state has shape {list(x.shape)} (several streams), which "
                f"the model reduces to one [B, T, D] state only after its last layer and with no module of its own "
                f"(transformers' hidden states are the streams too), so no layer has one residual state to read"
            )
        if self.want_residual:
            if self.reduce:
                self._pending = (record, x.detach())
            else:
                record.residual.append(x.detach())
        if layer == self.layout.num_layers and self.want_attentions:
            read = record.blocks()
            for f, b in self.layout.attention_rows:
                if (f, b) not in read:
                    module = self.layout.attention_modules[f] if b == 1 else self.layout.later_blocks[f][b - 2][1]
                    raise CaptureError(
                        f"{self._where(f)}: its attention module ({type(module).__name__}) did not run in this forward, "
                        f"so the layer has no attention map"
                    )

    def _layer_hooks(self, stack: contextlib.ExitStack) -> None:
        """Track which decoder-layer call is running, so that a shared module's calls go to their caller.

        The call about to run gives X[_next] (the residual hooks, registered first, have read X[0] already); a loop's
        module gives a different layer at each pass. A call the layout does not list there is one line, before its
        attention is read under a wrong layer."""
        layers, entries = self.layout.layers, self.layout.entries

        def enter(module, args):
            self._reduce_pending()
            layer = self._next
            if not (1 <= layer <= len(entries) and entries[layer - 1] is module):
                raise CaptureError(
                    f"{self._where(max(layer, 1))}: another decoder layer ran in its place (the model runs its layers "
                    f"in an order its layout does not list)"
                )
            self._layer = layer
            if self.want_attentions and layer in self.layout.attention_modules:
                self._follow_attention(layer, stack)

        def leave(module, args, output):
            self._layer = None

        for entry in {id(entry): entry for entry in entries}.values():
            stack.callback(entry.register_forward_pre_hook(enter).remove)
        for module in {id(module): module for module in layers}.values():
            stack.callback(module.register_forward_hook(leave).remove)

    def _follow_attention(self, layer: int, stack: contextlib.ExitStack) -> None:
        """Hook the attention module `layer` holds now, if the model replaced the one the layout found."""
        current = self.layout.attention_in(layer)
        if current is None or current is self.layout.attention_modules[layer]:
            return
        hooked = {id(m) for m in self.layout.attention_modules.values()}
        self.layout.attention_modules[layer] = current
        if id(current) not in hooked:
            stack.callback(current.register_forward_hook(self._attention_hook).remove)

    def _attention_hook(self, module, args, output) -> None:
        layer = self._layer
        if layer not in self.layout.attention_modules:
            return  # called outside the decoder layers that hold it (none of ours do)
        later = [m for _, m in self.layout.later_blocks.get(layer, [])]
        if module is not self.layout.attention_modules[layer] and module not in later:
            return  # another layer's block (a module shared by several layers)
        b = 1 if module is self.layout.attention_modules[layer] else 2 + later.index(module)
        weights = self.layout.view.weights(output, self.layout.weights_index)
        if weights is None:
            raise CaptureError(
                f"{self._where(layer)}: {type(module).__name__} returned no attention weights, so its attention map "
                f"cannot be captured"
            )
        record = self.records[-1]
        if (layer, b) in record.blocks():
            raise CaptureError(f"{self._where(layer)}: {type(module).__name__} ran twice in one layer; the analysis "
                               f"reads one map per block")
        weights = weights.detach()
        if self.reduce:
            record.first_token_attention[(layer, b)] = first_token_attention_of(weights)
            record.first_token_importance[(layer, b)] = first_token_importance_of(weights)
            record.received[(layer, b)] = received_attention_of(weights)
        elif b == 1:
            record.attentions[layer] = weights
        else:
            record.later_attentions[(layer, b)] = weights

    def _gate_hook(self, site: GateSite):
        def hook(module, args, output):
            layer = self._layer
            if layer not in self.layout.gates:
                return
            scores = gate_scores(site, module, output).detach()
            record = self.records[-1]
            if self.reduce:
                record.gate_summaries[layer] = gate_summary(scores_per_head(scores.float().cpu().double().numpy()))
            else:
                record.gates[layer] = scores

        return hook

    # context ---------------------------------------------------------
    def __enter__(self) -> Capture:
        stack = contextlib.ExitStack()
        try:
            if self.want_attentions and self.layout.weights_on_request:
                # A legacy class picks its weight-returning path itself when asked, as transformers' flag does; where
                # the installed release's class calls transformers' attention interface instead (Falcon's, in some),
                # it returns weights only when eager, so it is switched too where it can be.
                stack.enter_context(weights_requested(self.model))
            if self.want_attentions:
                stack.enter_context(eager_attention(self.model))
            stack.enter_context(torch_linear_attention(self.model))
            stack.callback(self.model.register_forward_pre_hook(self._on_forward).remove)  # opens each Record
            stack.callback(self.model.register_forward_hook(self._on_forward_end).remove)
            # The model whose forward runs the layers (the base model) returns before the whole does, and may run alone.
            runner = self._runner()
            if runner is not self.model:
                stack.callback(runner.register_forward_hook(self._reduce_pending).remove)
            # The residual hook checks each layer call comes in order, so it is always installed; before the layer
            # hooks, which read the position it has reached.
            stack.enter_context(residual_hooks(self.layout, self._on_residual))
            self._layer_hooks(stack)
            if self.want_attentions:
                blocks = [*self.layout.attention_modules.values(), *(m for later in self.layout.later_blocks.values() for _, m in later)]
                for module in {id(m): m for m in blocks}.values():
                    stack.callback(module.register_forward_hook(self._attention_hook).remove)
            if self.want_gates:
                sites = {id(site.module): site for site in self.layout.gates.values()}
                for site in sites.values():
                    stack.callback(site.module.register_forward_hook(self._gate_hook(site)).remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def _runner(self) -> nn.Module:
        """The innermost `PreTrainedModel` that holds the last decoder layer: its forward runs the layers."""
        from transformers import PreTrainedModel

        last, runner = self.layout.layers[-1], self.model
        for module in self.model.modules():  # outer models come first
            if isinstance(module, PreTrainedModel) and any(m is last for m in module.modules()):
                runner = module
        return runner

    def __exit__(self, *exc_info) -> None:
        stack, self._stack = self._stack, None
        self._reduce_pending()
        self._layer, self._in_forward = None, False
        if stack is not None:
            stack.close()
