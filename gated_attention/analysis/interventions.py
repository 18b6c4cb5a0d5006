"""Deletion, set-to-mean and connection interventions on the residual stream (docs/architecture.md, "Metric
definitions").

`z[l]` is one token t's residual state X[l][t, :] from a normal pass, `[L+1, D]`, l = 0..L (X[0] = embedding
output, X[l] = output of decoder layer l). The interventions act at residual positions p_1 < ... < p_K: by
default the inputs of the attention layers f_1 < ... < f_K (1-based), p_i = f_i - 1 (`attention_inputs`), and
on token t = 0, the first token; `intervene` takes other positions and tokens. `C_i` = top-k coordinates of
|z[p_i]|, chosen on each input's own z.

- Deletion: X[p_i][t, j] = 0 for j in C_i, every i.
- Set-to-mean (locuslab's massive-activations `--reset_type set_mean`): X[p_i][t, j] = mean_z[p_i, j] for j in
  C_i, every i, where mean_z is token t's z averaged over a set of inputs (`token_means`: the inputs analysed).
  Sun et al. 2024 (*Massive Activations in Large Language Models*) report that this keeps LLaMA2's perplexity
  where zeroing destroys it: the massive activation acts as a near-constant bias.
- Connection: with C = union of the C_i, for p_i < l < p_{i+1} and j in C,
  X[l][t, j] = s * max(|z_j(p_i)|, s * z_j(l)), s = sign(z_j(p_i)) (+1 at 0):
  the coordinate is held at least at the spike's magnitude, with its sign. At
  every p_i, X[p_i][t, j] = z_j(p_i) for j in C. Unselected coordinates follow
  the intervened computation.
- Identity check: pinning only the endpoints (the coordinates the intervention
  touches at each p_i, set to their normal-pass values) must give the normal
  logits bit for bit. `intervene` runs it every time and reports it.

An edit plan of one token is `{l: (coords [n] long, values [n])}`: set X[l][t, coords] = values. Several tokens
have one plan each, `{t: plan}`.

- First-token masking (`mask_first_token`): in the given attention layers, no
  query q >= 1 attends to key 0; the other keys share the whole weight (the
  softmax renormalises over them). Query 0 keeps its only key, itself. A
  persistent intervention: it holds for every forward, training ones too,
  while the context is open. The residual and the keys are untouched, so
  the first token still feeds every later token through the layers it is
  not masked in, and through none in the layers it is.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .capture import Capture, residual_hooks, torch_linear_attention
from .layout import model_layout

KINDS = ("deletion", "set-mean", "connection")
Edits = dict[int, tuple[torch.Tensor, torch.Tensor]]  # one token's plan: {l: (coords [n] long, values [n])}


def attention_inputs(attention_layers: Sequence[int]) -> list[int]:
    """The residual positions p = f - 1 that feed the (1-based) attention layers f, ascending: where the
    interventions act by default."""
    return [f - 1 for f in sorted(set(attention_layers))]


def select_coordinates(z: torch.Tensor, positions: Sequence[int], k: int) -> dict[int, torch.Tensor]:
    """`{p: C}`: the top-k coordinates of |z[p]| for each residual position p (sorted ascending)."""
    return {p: z[p].abs().topk(k).indices.sort().values for p in sorted(set(positions))}


def deletion_edits(z: torch.Tensor, positions: Sequence[int], k: int) -> Edits:
    coords = select_coordinates(z, positions, k)
    return {p: (c, torch.zeros(len(c), dtype=z.dtype, device=z.device)) for p, c in coords.items()}


def set_mean_edits(z: torch.Tensor, mean: torch.Tensor, positions: Sequence[int], k: int) -> Edits:
    """C_i chosen on this input's z, each set to its value in `mean` (`[L+1, D]`, the token's z averaged over inputs)."""
    coords = select_coordinates(z, positions, k)
    return {p: (c, mean[p, c].to(z.dtype)) for p, c in coords.items()}


def _union(coords: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.unique(torch.cat(list(coords.values()))) if coords else torch.zeros(0, dtype=torch.long)


def connection_edits(z: torch.Tensor, positions: Sequence[int], k: int) -> Edits:
    coords = select_coordinates(z, positions, k)
    c = _union(coords)
    positions = sorted(coords)
    edits: Edits = {p: (c, z[p, c]) for p in positions}
    for p, p_next in zip(positions[:-1], positions[1:]):
        spike = z[p, c]
        s = torch.where(spike >= 0, 1.0, -1.0).to(z.dtype)
        for layer in range(p + 1, p_next):
            edits[layer] = (c, s * torch.maximum(spike.abs(), s * z[layer, c]))
    return edits


def endpoint_edits(z: torch.Tensor, positions: Sequence[int], k: int, kind: str) -> Edits:
    """The identity check's plan: the coordinates `kind` touches at each p_i, pinned to z."""
    coords = select_coordinates(z, positions, k)
    if kind == "connection":
        c = _union(coords)
        coords = {p: c for p in coords}
    return {p: (c, z[p, c]) for p, c in coords.items()}


def build_edits(kind: str, z: torch.Tensor, positions: Sequence[int], k: int,
                mean: torch.Tensor | None = None) -> Edits:
    if kind == "deletion":
        return deletion_edits(z, positions, k)
    if kind == "set-mean":
        return set_mean_edits(z, mean, positions, k)
    if kind == "connection":
        return connection_edits(z, positions, k)
    raise ValueError(f"intervention must be one of {KINDS}, got {kind!r}")


@contextlib.contextmanager
def apply_edits(model: nn.Module, edits: Edits, token: int = 0) -> Iterator[None]:
    """While open, every forward of `model` sets X[layer][:, token, coords] = values for each planned layer.

    A model whose residual state cannot be edited as one `[B, T, D]` state (`View.edit_refusal`: several streams,
    prompt positions before the input) is a `ValueError` naming why."""
    with _edited(model, {token: edits}):
        yield


@contextlib.contextmanager
def _edited(model: nn.Module, plans: dict[int, Edits]) -> Iterator[None]:
    """`apply_edits` for several tokens at once: `{token: plan}`, one set of hooks."""
    layout = model_layout(model)
    if layout.view.edit_refusal:
        raise ValueError(f"{type(model).__name__}'s residual state cannot be edited: {layout.view.edit_refusal}")
    by_layer: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for token, edits in plans.items():
        for layer, (coords, values) in edits.items():
            by_layer.setdefault(layer, []).append((token, coords, values))

    def edit(layer: int, x: torch.Tensor) -> torch.Tensor | None:
        if layer not in by_layer:
            return None
        x = x.clone()
        for token, coords, values in by_layer[layer]:
            x[:, token, coords.to(x.device)] = values.to(device=x.device, dtype=x.dtype)
        return x

    with torch_linear_attention(model), residual_hooks(layout, edit):
        yield


def first_token_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """`mask` (the attention's own: None, bool `[B|1, 1|H, T, S]` True = attend, or additive float) with key 0
    blocked for every query at an absolute position >= 1 (query i of T sits at S - T + i, as with a cache).

    None becomes a bool causal mask `[1, 1, T, S]`: without a mask the attention was causal by its flag, which
    a given mask turns off."""
    positions = torch.arange(kv_len - q_len, kv_len, device=device)  # [T] absolute query positions
    keys = torch.arange(kv_len, device=device)  # [S]
    blocked = (keys[None, :] == 0) & (positions[:, None] >= 1)  # [T, S]
    if mask is None:
        return (keys[None, :] <= positions[:, None]) & ~blocked  # [T, S] -> broadcast as [1, 1, T, S] below
    if mask.dtype == torch.bool:
        return mask & ~blocked
    return mask.masked_fill(blocked, torch.finfo(mask.dtype).min)


@contextlib.contextmanager
def mask_first_token(model: nn.Module, layers: Sequence[int]) -> Iterator[None]:
    """While open, the softmax attention of each of `layers` (1-based) gives no weight to key 0 from queries
    q >= 1, in every forward (`first_token_mask`): the sink there is gone, for training and evaluation alike.

    A `with_kwargs` pre-hook on each attention module rewrites its `attention_mask` argument, so every
    attention implementation that honours a mask (eager, sdpa: the ones the recipes and `Capture` use) sees
    the same pattern; a mask of None (sdpa's causal flag) becomes an explicit causal one."""
    modules = model_layout(model).attention_modules
    missing = sorted(set(layers) - set(modules))
    if missing:
        raise ValueError(f"layers {missing} have no softmax attention (attention layers: {sorted(modules)})")

    def pre_hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        x = bound.arguments["hidden_states"]  # [B, T, D]
        mask = bound.arguments.get("attention_mask")
        extra = bound.arguments.get("kwargs", {})
        cache = next((c for c in (bound.arguments.get("cache"), bound.arguments.get("past_key_values"),
                                  extra.get("past_key_values")) if c is not None), None)
        past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        t = x.shape[1]
        new = first_token_mask(mask, t, past + t if mask is None else mask.shape[-1], x.device)
        bound.arguments["attention_mask"] = new[None, None] if new.dim() == 2 else new
        return bound.args, bound.kwargs

    handles = []
    try:
        for layer in sorted(set(layers)):
            handles.append(modules[layer].register_forward_pre_hook(pre_hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class InterventionResult:
    kind: str
    k: int
    logits_normal: torch.Tensor  # [1, T, V]
    logits_intervened: torch.Tensor  # [1, T, V]
    identity_exact: bool
    identity_max_abs_diff: float
    coordinates: dict[int, dict[int, list[int]]]  # token t -> {p_i: C_i}


@torch.no_grad()
def token_means(model: nn.Module, inputs: Sequence[torch.Tensor], tokens: Sequence[int] = (0,)) -> dict[int, torch.Tensor]:
    """Each token t's residual states X[0..L][t, :] averaged over `inputs` (each `[1, T]`, T > max(tokens)):
    `{t: [L+1, D]}` float64, on the CPU. What `set-mean` sets the chosen coordinates to."""
    if not inputs:
        raise ValueError("token_means needs at least one input")
    tokens = sorted(set(tokens))
    totals: dict[int, torch.Tensor] = {}
    with Capture(model, attentions=False, gates=False) as cap:
        for input_ids in inputs:
            cap.clear()  # one input's states at a time
            model(input_ids=input_ids, use_cache=False)
            residual = cap.records[-1].residual
            for t in tokens:
                z = torch.stack([x[0, t].cpu().double() for x in residual])  # [L+1, D]
                totals[t] = z if t not in totals else totals[t] + z
    return {t: total / len(inputs) for t, total in totals.items()}


@torch.no_grad()
def intervene(model: nn.Module, input_ids: torch.Tensor, kind: str, k: int, *,
              mean: dict[int, torch.Tensor] | None = None, positions: Sequence[int] | None = None,
              tokens: Sequence[int] = (0,)) -> InterventionResult:
    """Normal pass, identity check and intervened pass on one input `[1, T]`.

    The edits act on each of `tokens` (0-based positions, default the first token) at the residual positions
    `positions` (l = 0..L: X[0] the embedding output, X[l] the output of decoder layer l; default the attention
    layers' inputs, `attention_inputs`); connection holds its coordinates between consecutive positions.
    `mean` (`{t: [L+1, D]}`, `token_means` over the inputs) is what "set-mean" sets the coordinates to.
    The three passes run under the model's own attention implementation (no
    switch to eager), so the identity check compares like with like.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"intervene takes one input [1, T], got shape {tuple(input_ids.shape)}")
    if kind not in KINDS:
        raise ValueError(f"intervention must be one of {KINDS}, got {kind!r}")
    tokens = sorted(set(tokens))
    if kind == "set-mean" and (mean is None or any(t not in mean for t in tokens)):
        raise ValueError("set-mean sets each coordinate to its mean over the inputs: pass "
                         "mean=token_means(model, inputs, tokens)")
    with Capture(model, attentions=False, gates=False) as cap:
        logits_normal = model(input_ids=input_ids, use_cache=False).logits
    positions = attention_inputs(cap.layout.attention_layers) if positions is None else sorted(set(positions))
    residual = cap.records[-1].residual
    z = {t: torch.stack([x[0, t].cpu() for x in residual]) for t in tokens}  # [L+1, D] each; layers may sit on several devices

    with _edited(model, {t: endpoint_edits(z[t], positions, k, kind) for t in tokens}):
        logits_identity = model(input_ids=input_ids, use_cache=False).logits
    with _edited(model, {t: build_edits(kind, z[t], positions, k, mean[t] if mean else None) for t in tokens}):
        logits_intervened = model(input_ids=input_ids, use_cache=False).logits

    diff = (logits_identity.float() - logits_normal.float()).abs().max().item() if logits_normal.numel() else 0.0
    return InterventionResult(
        kind=kind,
        k=k,
        logits_normal=logits_normal,
        logits_intervened=logits_intervened,
        identity_exact=bool(torch.equal(logits_identity, logits_normal)),
        identity_max_abs_diff=float(diff),
        coordinates={t: {p: c.tolist() for p, c in select_coordinates(z[t], positions, k).items()} for t in tokens},
    )
