"""A compressed-tensors scheme applied to chosen linear maps of a copy of a model, with min-max scales.

compressed-tensors does the format's work: `apply_quantization_config` attaches the scheme and its scale
parameters to each chosen `nn.Linear` and replaces its forward with the quantize-dequantize forward
(`set_forward_quantized`); `calculate_qparams` and `generate_gparam` turn a minimum and maximum into a scale,
zero point and global scale exactly as its observers' results are turned. What is left to this module is what a
calibration algorithm would choose, and here is the plainest choice, round-to-nearest with min-max scales:

- static weight scales from each weight's minimum and maximum per the scheme's strategy (per tensor, output
  channel, group of input columns, or block);
- activations that the scheme rounds dynamically (per token, group) get their scales as compressed-tensors
  computes them, per call;
- static activation scales (FP8's per-tensor input scale) and global scales (NVFP4's) from the minimum and
  maximum of each layer's input over the calibration inputs, run through the model unquantized;
- a weight's global scale (NVFP4's) from its own minimum and maximum, or its fused siblings' together
  (`targets.FUSED_SIBLINGS`: q/k/v, gate/up), which an engine multiplies as one matrix.

A fused projection whose output rows hold two things (Qwen3.5's `q_proj`: each head's query, then its gate) can
have some rows rounded and the others not (`rows`), which no stored format can: the measurement's way of telling
which half a quantizer hurts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .schemes import scheme as preset_scheme
from .targets import sibling_groups



def _minmax(value: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` `[out, in]` reduced to its minima and maxima per the strategy, in the shape of its scale:
    tensor `[1]`, channel `[out, 1]`, group `[out, in / g]`, block `[ceil(out / bo), in / bi]`."""
    from compressed_tensors.quantization import QuantizationStrategy as S

    if args.strategy == S.TENSOR:
        return value.amin().reshape(1), value.amax().reshape(1)
    if args.strategy == S.CHANNEL:
        return value.amin(-1, keepdim=True), value.amax(-1, keepdim=True)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        grouped = value.unflatten(-1, (value.shape[-1] // args.group_size, args.group_size))  # [out, in / g, g]
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == S.BLOCK:
        bo, bi = args.block_structure
        rows = -value.shape[0] % bo  # a last block of fewer rows: zeros change no minimum <= 0 <= maximum
        padded = F.pad(value, (0, 0, 0, rows)).reshape(-1, bo, value.shape[1] // bi, bi)  # [out / bo, bo, in / bi, bi]
        return padded.amin((1, 3)), padded.amax((1, 3))
    raise ValueError(f"no static scales for strategy {args.strategy}")


def _set_qparams(module: nn.Module, base: str, args, low: torch.Tensor, high: torch.Tensor, overall) -> None:
    """Write the scale, zero point and (tensor-group) global scale of `module`'s `base` ("weight", "input")."""
    from compressed_tensors.quantization import DynamicType, QuantizationStrategy as S
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    global_scale = None
    if args.strategy == S.TENSOR_GROUP:  # NVFP4: one fp32 scale over the tensor, so the group scales fit in fp8
        global_scale = generate_gparam(*overall)
        getattr(module, f"{base}_global_scale").data.copy_(global_scale)
    if args.dynamic in (True, DynamicType.LOCAL):
        return  # the local scales are computed per call
    scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
    parameter = getattr(module, f"{base}_scale")
    parameter.data = scale.to(parameter.dtype).reshape(parameter.shape)
    if (zp := getattr(module, f"{base}_zero_point", None)) is not None:
        zp.data = zero_point.to(zp.dtype).reshape(zp.shape)


@torch.no_grad()
def _calibrate_weights(model: nn.Module, paths: list[str]) -> None:
    """Each weight's scales; its global scale (NVFP4's) over its `FUSED_SIBLINGS` where every one of them is
    rounded, which an engine multiplies as one matrix (vLLM's qkv_proj, gate_up_proj) with one global scale, as
    llm-compressor's oneshot shares it; else over itself."""
    rounded = set(paths)
    overall: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    for path in paths:
        linear = model.get_submodule(path)
        args = linear.quantization_scheme.weights
        if args is None:
            continue
        group = next((g for g in sibling_groups(path) if rounded.issuperset(g)), (path,))
        if group not in overall:
            weights = [model.get_submodule(p).weight.float() for p in group]
            overall[group] = (min(w.amin() for w in weights), max(w.amax() for w in weights))
        _set_qparams(linear, "weight", args, *_minmax(linear.weight.float(), args), overall[group])


@torch.no_grad()
def run_observed(model: nn.Module, observers: dict[nn.Module, Callable], inputs: Iterable[torch.Tensor]) -> None:
    """Run `model` on each of `inputs` (token ids `[1, T]`), each observer called with its module's input first
    (`observer(module, args)`, a forward pre-hook, removed afterwards)."""
    hooks = [module.register_forward_pre_hook(observer) for module, observer in observers.items()]
    try:
        for ids in inputs:
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def _calibrate_inputs(model: nn.Module, linears: list[nn.Linear], inputs: Iterable[torch.Tensor]) -> None:
    """Static input scales and global scales from each layer's input over `inputs`, the model run unquantized."""
    static = [m for m in linears if (a := m.quantization_scheme.input_activations) is not None and a.dynamic is not True]
    if not static:
        return
    seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(module, args):
        x = args[0].detach().float()
        low, high = seen.get(module, (x.amin(), x.amax()))
        seen[module] = (torch.minimum(low, x.amin()), torch.maximum(high, x.amax()))

    for m in linears:
        m.quantization_enabled = False
    try:
        run_observed(model, {m: observe for m in static}, inputs)
    finally:
        for m in linears:
            m.quantization_enabled = True
    for module, (low, high) in seen.items():
        args = module.quantization_scheme.input_activations
        _set_qparams(module, "input", args, low.reshape(1), high.reshape(1), (low, high))


@torch.no_grad()
def _round_weight_once(linear: nn.Linear) -> None:
    """Store the weight quantized and dequantized, and mark it so: compressed-tensors' forward then rounds only the
    activations. The same numbers as rounding the weight at every call (the scales are fixed), at a fraction of the
    cost: the weight's round trip per call otherwise costs more than the matmul. Only for a copy that is measured,
    never compressed: `ModelCompressor` reads a status of `COMPRESSED` as weights that are packed already."""
    from compressed_tensors.quantization import QuantizationStatus, forward_quantize

    if linear.quantization_scheme.weights is None:
        return
    linear.weight.data = forward_quantize(linear, linear.weight.data, "weight", linear.quantization_scheme.weights)
    linear.quantization_status = QuantizationStatus.COMPRESSED


def _round_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Only `rows` (a boolean mask `[out_features]`) of `linear`'s output come from its quantized forward."""
    quantized = linear.forward  # compressed-tensors' quantize-dequantize forward, bound to the module
    mask = rows.to(linear.weight.device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, quantized(x), F.linear(x, linear.weight, linear.bias))

    linear.forward = forward


def quantized_copy(model: nn.Module, name: str, targets: dict[str, torch.Tensor | None],
                   calibration: Iterable[torch.Tensor] = ()) -> nn.Module:
    """A copy of `model` whose linear maps at the paths of `targets` round as the preset `name` does, scales
    from min-max (static activation scales from `calibration`, token ids `[1, T]` each); a target's value, if
    not None, is the mask of its output rows that round (the others stay as they were). `model` is untouched."""
    quantized = copy.deepcopy(model)
    _apply(quantized, name, list(targets), calibration)
    for path, rows in targets.items():
        if rows is None:
            _round_weight_once(quantized.get_submodule(path))
        else:  # the other rows keep the weight as it was
            _round_rows(quantized.get_submodule(path), rows)
    return quantized


def quantize_in_place(model: nn.Module, name: str, paths: list[str], calibration: Iterable[torch.Tensor] = ()) -> None:
    """`model`'s linear maps at `paths` round as the preset `name` does (as `quantized_copy`, whole rows)."""
    _apply(model, name, paths, calibration)


def _apply(model: nn.Module, name: str, paths: list[str], calibration: Iterable[torch.Tensor]) -> None:
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    linears = [model.get_submodule(path) for path in paths]
    config = QuantizationConfig(config_groups={"group_0": preset_scheme(name)})
    apply_quantization_config(model, config, show_progress=False, allowed_modules=linears)
    _calibrate_weights(model, paths)
    _calibrate_inputs(model, linears, calibration)
