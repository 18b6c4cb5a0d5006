"""compressed-tensors' preset schemes by name, and the checks a model must pass before one is applied.

The names are compressed-tensors' own (`PRESET_SCHEMES`, the format vLLM and llm-compressor share), taken
case-insensitively; nothing here redefines a format.
"""

from __future__ import annotations

import math

from torch import nn

INSTALL = 'pip install "gated-attention[quant]"'


class QuantizationError(ValueError):
    """A scheme or model the quantization cannot take; the message is one line for the user."""


def presets() -> dict:
    """compressed-tensors' preset schemes, name -> arguments; `QuantizationError` naming the install line without it."""
    try:
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    except ImportError:
        raise QuantizationError(f"quantization needs compressed-tensors, which is not installed: {INSTALL}") from None
    return PRESET_SCHEMES


def canonical(name: str) -> str:
    """A preset's name as compressed-tensors writes it (upper case), or `QuantizationError` listing the presets."""
    known = presets()
    if name.upper() not in known or name.upper() == "UNQUANTIZED":
        names = ", ".join(n for n in known if n != "UNQUANTIZED")
        raise QuantizationError(f"unknown quantization scheme {name!r}: compressed-tensors' presets are {names}")
    return name.upper()


def scheme(name: str):
    """The `QuantizationScheme` of a preset, targeting linear maps."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(canonical(name), ["Linear"])


def weight_bits(name: str) -> int:
    return scheme(name).weights.num_bits


def check_shapes(name: str, linears: dict[str, nn.Linear]) -> None:
    """Every layer the scheme rounds is tiled by its groups (the input width a multiple of the group size) and
    its blocks' columns, as vLLM's kernels and compressed-tensors' packing need; `QuantizationError` naming the
    first layer that is not."""
    from compressed_tensors.quantization import QuantizationStrategy as S

    s = scheme(name)
    for args in (s.weights, s.input_activations):
        if args is None:
            continue
        if args.strategy in (S.GROUP, S.TENSOR_GROUP):
            width = args.group_size
            what = f"group size {width}"
        elif args.strategy == S.BLOCK:
            width = args.block_structure[-1]
            what = f"block of {args.block_structure[0]}x{width}"
        else:
            continue
        for path, linear in linears.items():
            if linear.in_features % width:
                raise QuantizationError(
                    f"{canonical(name)}'s {what} does not divide {path}'s input width {linear.in_features} "
                    f"({math.ceil(linear.in_features / width)} groups would be ragged)")
