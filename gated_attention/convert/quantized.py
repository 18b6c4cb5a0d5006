"""Quantized sources, read dequantized one tensor at a time: transformers' fine-grained FP8 and compressed-tensors.

A source whose config.json has a `quantization_config` stores some weights as quantized parts: an FP8 weight and its
block scales (`weight_scale_inv`), or compressed-tensors' packed integers, scales and zero points. `dequantized_view`
maps those parts onto the tensors the model holds (`model.layers.0.self_attn.o_proj.weight`, in `dtype`), each made
from its parts only when the conversion reads it, so memory holds one tensor and its parts, as for any source. The
other tensors (norms, embeddings, whatever the format leaves unquantized) are read as they are stored.

- `fp8` (transformers' `FineGrainedFP8Config`): `weight` float8 `[N, K]`, `weight_scale_inv` `[ceil(N / bn),
  ceil(K / bk)]` for `weight_block_size` `[bn, bk]` (one scale per tensor without it); each block of the weight times
  its scale, in float32 (a float8 times a float32 rounds once), then cast to `dtype`, as transformers' dequantizing
  load does (`Fp8Dequantize`).
- `compressed-tensors`, formats `FORMATS`: compressed-tensors' own decompression (its compressor for the scheme's
  format, `decompress` of the module's parts), then cast to `dtype`, as its `CompressedTensorsDequantizer` does.

In float32 the result is exact for every FP8 block and the library's numbers for compressed-tensors; in bfloat16 each
weight is rounded once, after the scale. Anything else is refused in one line naming its `quant_method`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch

from .errors import ConversionError

FP8 = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
# compressed-tensors' formats read here: FP8, INT8 and packed INT4/INT8 (W4A16, W8A16) weights.
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def describe(quantization: dict) -> str:
    """The source's format in a few words, for the card and the log."""
    method = quantization.get("quant_method")
    if method == FP8:
        block = quantization.get("weight_block_size")
        return f"fp8 (float8 weights, {'x'.join(map(str, block)) + ' blocks' if block else 'one scale a tensor'})"
    return f"{method} ({quantization.get('format')})"


def dequantizing_load(quantization: dict | None) -> dict:
    """What transformers' `from_pretrained` loads a quantized SRC with to hold the weights this module reads: each
    weight dequantized while loading, run as a plain linear map (no FP8 kernel, no activation rounding)."""
    if quantization is None:
        return {}
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    if quantization.get("quant_method") == FP8:
        block = quantization.get("weight_block_size")
        return {"quantization_config": FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(block) if block else None,
                                                            activation_scheme=quantization.get("activation_scheme", "dynamic"))}
    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


class DequantizingLoad:
    """`cls.from_pretrained` (default: the Auto class's choice) of a quantized SRC with `dequantizing_load`, every
    module then left a plain one: transformers before 5.2x keeps compressed-tensors' scheme on a decompressed
    module, whose forward still rounds its input to the scheme's activations (FP8_DYNAMIC, W8A8)."""

    def __init__(self, cls, quantization: dict):
        self.cls, self.quantization = cls, quantization

    def from_pretrained(self, folder, **kwargs):
        from transformers import AutoModelForCausalLM

        loaded = (self.cls or AutoModelForCausalLM).from_pretrained(folder, **kwargs, **dequantizing_load(self.quantization))
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        schemed = [m for m in model.modules() if hasattr(m, "quantization_scheme")]
        if schemed:
            from compressed_tensors.quantization import QuantizationMetadata

            for module in schemed:
                QuantizationMetadata.clear_quantization(module)  # the scheme, its qparams, the wrapped forward
        return loaded


def source_loader(cls, quantization: dict | None):
    """What loads SRC for the verification: `cls` itself, or for a quantized SRC `cls` through `DequantizingLoad`."""
    return cls if quantization is None else DequantizingLoad(cls, quantization)


def dequantized_view(quantization: dict, tensors: dict, read, dtype: torch.dtype) -> dict:
    """SRC's tensors as the model holds them: `tensors` ({name: TensorInfo}) with each quantized weight's parts
    replaced by one `TensorInfo` of the weight in `dtype` whose `dequantize` makes it from its parts. `read(info)` reads
    a stored tensor (the small ones a shape needs: a packed weight's `weight_shape`)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == FP8:
        return _fp8_view(quantization, tensors, dtype)
    if method == COMPRESSED_TENSORS:
        return _compressed_view(quantization, tensors, read, dtype)
    raise ConversionError(f"SRC is quantized with quant_method {method!r}, which convert cannot read; it reads "
                          f"{FP8} (block float8) and {COMPRESSED_TENSORS} ({', '.join(FORMATS)}): dequantize SRC first")


def _dequantized(weight, parts: tuple, dtype: torch.dtype, make) -> object:
    """The `TensorInfo` of a weight made from `parts` (its own info first) by `make(*tensors)`."""
    return replace(weight, dtype=dtype, parts=parts, dequantize=make)


# --- transformers' fine-grained FP8 -------------------------------------------------------------------------------


def _fp8_view(quantization: dict, tensors: dict, dtype: torch.dtype) -> dict:
    block = quantization.get("weight_block_size")
    view = {}
    for name, info in tensors.items():
        if name.endswith((".weight_scale_inv", ".activation_scale", ".input_scale")):
            if name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") not in tensors:
                raise ConversionError(f"SRC has the FP8 scale {name} but no weight {name.removesuffix('_scale_inv')}")
            continue
        scale = tensors.get(f"{name}_scale_inv")
        if info.dtype not in FLOAT8:
            if scale is not None:
                raise ConversionError(f"SRC's {name} is {str(info.dtype).removeprefix('torch.')} and has an FP8 scale "
                                      f"{scale.name}: not a float8 weight")  # fmt: skip
            view[name] = info
            continue
        if scale is None:
            raise ConversionError(f"SRC's FP8 weight {name} has no scale {name}_scale_inv: SRC is incomplete")
        view[name] = _dequantized(info, (info, scale), dtype, partial(_fp8_weight, block=_fp8_grid(name, info, scale, block),
                                                                       dtype=dtype))
    return view


def _fp8_grid(name: str, weight, scale, block) -> tuple[int, int] | None:
    """The block size `[bn, bk]` after checking the scale's shape against the weight's, or None (one scale)."""
    if block is None:
        if math.prod(scale.shape) != 1:
            raise ConversionError(f"SRC's FP8 scale {scale.name} has shape {list(scale.shape)}; without "
                                  "weight_block_size it must be one number")  # fmt: skip
        return None
    if len(weight.shape) != 2 or not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise ConversionError(f"SRC's FP8 weight {name} has shape {list(weight.shape)} and weight_block_size {block}: "
                              "convert reads 2-D weights in 2-D blocks")  # fmt: skip
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != want:
        raise ConversionError(f"SRC's FP8 scale {scale.name} has shape {list(scale.shape)}; weight {list(weight.shape)} "
                              f"in blocks of {list(block)} needs {list(want)}")  # fmt: skip
    return tuple(block)


def _fp8_weight(weight: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int] | None, dtype) -> torch.Tensor:
    """`weight` `[N, K]` float8 times its scales (one per `block`), in float32, then in `dtype`."""
    scale = scale.to(torch.float32)
    if block is None:
        return (weight.to(torch.float32) * scale.reshape(())).to(dtype)
    rows, cols = weight.shape
    scale = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]  # [N, K]
    return (weight.to(torch.float32) * scale).to(dtype)


# --- compressed-tensors -------------------------------------------------------------------------------------------


def _compressed_view(quantization: dict, tensors: dict, read, dtype: torch.dtype) -> dict:
    try:
        import compressed_tensors  # noqa: F401 - an optional dependency (the `quant` extra)
    except ImportError:
        raise ConversionError(f"SRC is quantized with quant_method {COMPRESSED_TENSORS}, which convert reads with the "
                              "compressed-tensors package: pip install 'gated-attention[quant]'") from None
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    try:
        config = QuantizationConfig.model_validate(quantization)
    except ValueError as e:
        raise ConversionError(f"SRC's quantization_config (quant_method {COMPRESSED_TENSORS}) is not one "
                              f"compressed-tensors reads: {str(e).splitlines()[0]}") from None
    made, hidden = {}, set()  # first part's name -> the weight made from it; every stored name it replaces
    for scheme in config.config_groups.values():
        form = str(getattr(scheme.format, "value", scheme.format) or config.format)
        if form not in FORMATS:
            raise ConversionError(f"SRC is quantized with quant_method {COMPRESSED_TENSORS}, format {form}, which convert "
                                  f"cannot read; it reads {', '.join(FORMATS)}: dequantize SRC first")
        compressor = BaseCompressor.get_value_from_registry(form)
        names = compressor.compression_param_names(scheme)
        for module, first in list(match_quantizable_tensors(tensors, ignore=config.ignore, targets=scheme.targets,
                                                            param_targets=[names[0]])):
            missing = [part for part in names if f"{module}.{part}" not in tensors]
            if missing and names[0] == "weight":  # a plain weight, stored as it is (embeddings, an ignored layer)
                continue
            if missing:
                raise ConversionError(f"SRC lacks {module}.{missing[0]}, a part of its {form} weight: SRC is incomplete")
            parts = tuple(tensors[f"{module}.{part}"] for part in names)
            shape = (tuple(int(n) for n in read(tensors[f"{module}.weight_shape"]).tolist()) if "weight_shape" in names
                     else parts[0].shape)  # fmt: skip
            make = partial(_compressed_weight, compressor, scheme, names, dtype=dtype)
            made[first] = replace(_dequantized(parts[0], parts, dtype, make), name=f"{module}.weight", shape=shape)
            hidden |= {name for name in tensors if name.startswith(f"{module}.") and name[len(module) + 1 :] in _QPARAMS}
    view = {}
    for name, info in tensors.items():  # in SRC's order: a weight where its first part was
        if name in made:
            view[made[name].name] = made[name]
        elif name not in hidden:
            view[name] = info
    return view


_QPARAMS = ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_global_scale",
            "input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point", "k_scale",
            "v_scale")


def _compressed_weight(compressor, scheme, names, *parts: torch.Tensor, dtype) -> torch.Tensor:
    return compressor.decompress(dict(zip(names, parts)), scheme)["weight"].to(dtype)
