"""The weight plan: every output tensor of a conversion, named, shaped and checked before a byte is written.

The output tensors are the source tensors renamed where needed (Mixtral's
expert names; per-expert tensors fused), `o_proj` doubled, and the new gate
parameters.

Exact init (docs/architecture.md, "The conversion pipeline"): gate weight 0 and no
bias, so every score is sigmoid(0) = 0.5 exactly; `o_proj` is doubled, which
is exact in every float format, so `o_proj(0.5 * y)` with `2 W` is `W y` to
the bit. `--init bias` instead leaves `o_proj` alone and sets a large gate bias
(sigmoid(10) = 1 - 4.5e-5): close to the source, not equal, and the gate's
gradient is scaled by sigmoid'(10) = 4.5e-5.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .sources import ConversionError, SourceCheckpoint, first_non_finite
from .writer import OutputTensor

GATE_BIAS_INIT = 10.0  # --init bias: sigmoid(10) = 0.9999546

# Buffers some older checkpoints carry that no model loads.
IGNORED_SOURCE_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")

# --- rules: renames, fusions and splits, declared per family (`families.FAMILIES`) -----------------------


@dataclass(frozen=True)
class Rename:
    """A source tensor under another name: `re.sub(pattern, replacement, name)` (transformers' `WeightRenaming`)."""

    pattern: str
    replacement: str

    def target(self, name: str, source) -> str:
        return re.sub(self.pattern, self.replacement, name)


@dataclass(frozen=True)
class RenameByLayerType:
    """`model.layers.N.<part>.` -> `<attention>` where the source's layer N is an attention layer, else `<linear>`
    (an fla hybrid keeps both kinds of mixer under `attn`; `source.attention_layers` says which is which)."""

    part: str
    attention: str
    linear: str

    def target(self, name: str, source) -> str:
        m = re.match(rf"^model\.layers\.(\d+)\.{re.escape(self.part)}\.", name)
        if not m:
            return name
        mixer = self.attention if int(m[1]) in source.attention_layers else self.linear
        return f"model.layers.{m[1]}.{mixer}." + name[m.end() :]


@dataclass(frozen=True)
class Split:
    """One fused source tensor cut along dim 0 into consecutive target tensors, in row order (transformers'
    `Chunk`). Names are suffixes of the tensor name; each part's rows are the target model's shape for it,
    so the split needs no config field of its own."""

    source: str  # e.g. "self_attn.qkv_proj.weight"
    targets: tuple[str, ...]  # e.g. q_proj, k_proj, v_proj weights


@dataclass(frozen=True)
class FuseExperts:
    """Per-expert tensors (the layout transformers 5 still saves for Qwen3-MoE and Mixtral) fused into our
    MoE's in-memory layout: gate_up_proj [E, 2I, H] (expert e = gate_e rows then up_e rows), down_proj [E, H, I]."""


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def renamer(rules, source=None):
    """Source name -> target name, the rules' renames applied in order."""
    renames = [r for r in rules if isinstance(r, (Rename, RenameByLayerType))]

    def rename(name: str) -> str:
        for rule in renames:
            name = rule.target(name, source)
        return name

    return rename


def key_mapping(rules, source, num_layers: int) -> dict[str, str]:
    """The rules' renames as transformers' `from_pretrained(key_mapping=...)` applies them while loading (a
    regex and its replacement, `\\1` for its one group), so that a model reads SRC's files under our names."""
    mapping = {}
    for rule in rules:
        if isinstance(rule, Rename):
            mapping[rule.pattern] = rule.replacement
        elif isinstance(rule, RenameByLayerType):
            for n in range(num_layers):
                mixer = rule.attention if n in source.attention_layers else rule.linear
                mapping[rf"^model\.layers\.{n}\.{re.escape(rule.part)}\."] = f"model.layers.{n}.{mixer}."
        else:
            raise ValueError(f"{type(rule).__name__} changes tensors, not only names: transformers cannot apply it while loading")
    return mapping


# --- reading ---------------------------------------------------------------------------------------------


def _read(ckpt: SourceCheckpoint, name: str, dtype: torch.dtype, scale: float = 1.0, rows: slice | None = None) -> torch.Tensor:
    """Source tensor `name` (its `rows` only, for a `Split`) in `dtype`, times `scale`."""
    source = t = ckpt.read(name) if rows is None else ckpt.read(name)[rows]
    if t.dtype != dtype:
        t = t.to(dtype)
    if scale != 1.0:
        # A power of two: exact in every float format. Out of place: writing into the file's private
        # mapping faults page by page (copy on write), 15x slower than a fresh product on this machine.
        t = t * scale
    if t is not source and (i := first_non_finite(t)) is not None:  # SRC is finite (checked): this made the inf
        value = source.reshape(-1)[i].item()
        where = [int(k) for k in np.unravel_index(i, source.shape)]
        where[0] += rows.start if rows is not None else 0
        cause = (
            f"{str(dtype).removeprefix('torch.')} cannot hold it (--dtype)"
            if not torch.isfinite(source.reshape(-1)[i : i + 1].to(dtype)).all()
            else "doubling o_proj (--init exact) makes it inf; --init bias leaves o_proj as it is"
        )
        raise ConversionError(f"SRC tensor {name} holds {value:g} at {where}: {cause}")
    return t


def _read_each(ckpt: SourceCheckpoint, names: list[str], dtype: torch.dtype):
    for name in names:  # one expert matrix in memory at a time
        yield _read(ckpt, name, dtype)


def _full(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


def _out_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    return requested if requested is not None and source.is_floating_point else source


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ConversionError(f"tensor {name} has shape {list(got)} in SRC but its config implies {list(want)}")


def _fused_experts(ckpt: SourceCheckpoint, grouped: dict, dtype, expected) -> list[OutputTensor]:
    """Output tensors for per-expert source tensors, grouped as {(prefix): {expert: {proj: source name}}}."""
    outputs = []
    for prefix, experts in grouped.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise ConversionError(f"SRC's experts under {prefix} are numbered {ids[:8]}..., not 0..{len(ids) - 1}")
        for target, projs in ((f"{prefix}.gate_up_proj", ("gate_proj", "up_proj")), (f"{prefix}.down_proj", ("down_proj",))):
            names = []
            for e in ids:
                for proj in projs:
                    if proj not in experts[e]:
                        raise ConversionError(f"SRC lacks tensor {prefix}.{e}.{proj}.weight (expert {e} is incomplete)")
                    names.append(experts[e][proj])
            if target not in expected:
                raise ConversionError(f"SRC has experts under {prefix}, which a model with this config does not have")
            rows, cols = ckpt.tensors[names[0]].shape
            for n in names:
                _check_shape(n, ckpt.tensors[n].shape, (rows, cols))
            _check_shape(f"{prefix}.*.{'/'.join(projs)} (fused)", (len(ids), rows * len(projs), cols), expected[target])
            out_dtype = _out_dtype(ckpt.tensors[names[0]].dtype, dtype)
            outputs.append(OutputTensor(target, expected[target], out_dtype, partial(_read_each, ckpt, names, out_dtype), names))
    return outputs


def _split(ckpt: SourceCheckpoint, src_name: str, name: str, split: Split, expected, dtype, model_type) -> list[OutputTensor]:
    """The parts of a fused tensor, as many rows each as the target model has for it."""
    info = ckpt.tensors[src_name]
    stem = name.removesuffix(split.source)
    targets = [stem + t for t in split.targets]
    for target in targets:
        if target not in expected:
            raise ConversionError(f"SRC has tensor {src_name}, whose part {target} a {model_type} model with this config does not have")
    shapes = [expected[t] for t in targets]
    _check_shape(src_name, tuple(info.shape), (sum(s[0] for s in shapes), *shapes[0][1:]))
    out_dtype = _out_dtype(info.dtype, dtype)
    outputs, start = [], 0
    for target, shape in zip(targets, shapes):
        rows = slice(start, start + shape[0])
        outputs.append(OutputTensor(target, shape, out_dtype, partial(_read, ckpt, src_name, out_dtype, 1.0, rows), [src_name]))
        start = rows.stop
    return outputs


def plan_weights(
    ckpt: SourceCheckpoint,
    expected: dict[str, tuple[int, ...]],
    config,
    *,
    init: str,
    dtype: torch.dtype | None,
    rules=(),
    source=None,
) -> list[OutputTensor]:
    """Output tensors of a conversion (`init` "exact" or "bias") or a copy (`init` "copy"), in source order.

    `expected` is the target model's `expected_shapes` (or `dense_shapes`) for
    `config`: which tensors must exist and their shapes, so every name and
    shape is checked before anything is written. `rules` are the family's
    renames, splits and fusions (`source`, its source config, is what a rule
    may read). Gate tensors follow their layer's `o_proj`, so they land in the
    same shard as the rest of the layer.
    """
    rename = renamer(rules, source)
    splits = [r for r in rules if isinstance(r, Split)]
    fuse = any(isinstance(r, FuseExperts) for r in rules)
    tied = getattr(config, "tie_word_embeddings", False)
    renamed = {src_name: rename(src_name) for src_name in ckpt.tensors}
    present = set(renamed.values())
    outputs: list[OutputTensor | str] = []  # a str marks where a layer's fused experts go
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for src_name, info in ckpt.tensors.items():
        if IGNORED_SOURCE_TENSORS.search(src_name) or (tied and src_name == "lm_head.weight"):
            continue  # with tied embeddings the model uses embed_tokens for lm_head, as the source does
        name = renamed[src_name]
        split = next((r for r in splits if name.endswith("." + r.source)), None)
        if split is not None:
            outputs.extend(_split(ckpt, src_name, name, split, expected, dtype, config.model_type))
            continue
        m = _PER_EXPERT.match(name) if fuse else None
        if m:
            layer = experts.setdefault(m["prefix"], {})
            if not layer:  # the fused tensors go where the layer's first expert was
                outputs.append(m["prefix"])
            layer.setdefault(int(m["expert"]), {})[m["proj"]] = src_name
            continue
        if name not in expected:
            raise ConversionError(f"SRC has tensor {src_name}, which a {config.model_type} model with this config does not have")
        _check_shape(src_name, info.shape, expected[name])
        out_dtype = _out_dtype(info.dtype, dtype)
        double = init == "exact" and name.endswith("self_attn.o_proj.weight")
        unchanged = ckpt.format == "safetensors" and out_dtype == info.dtype and not double
        make = partial(_read, ckpt, src_name, out_dtype, 2.0 if double else 1.0)
        outputs.append(OutputTensor(name, info.shape, out_dtype, make, [src_name], copy_of=info if unchanged else None))
        if name.endswith("self_attn.o_proj.weight"):
            prefix = name.removesuffix("o_proj.weight") + "attn_gate."
            for suffix, value in (("weight", 0.0), ("bias", GATE_BIAS_INIT if init == "bias" else 0.0)):
                if prefix + suffix in expected and prefix + suffix not in present:
                    shape = expected[prefix + suffix]
                    make = partial(_full, shape, out_dtype, value)
                    zeros = value == 0.0 and math.copysign(1.0, value) > 0
                    outputs.append(OutputTensor(prefix + suffix, shape, out_dtype, make, zeros=zeros))
    fused = {o.name: o for o in _fused_experts(ckpt, experts, dtype, expected)}
    planned: list[OutputTensor] = []
    for item in outputs:
        planned.extend([fused[f"{item}.gate_up_proj"], fused[f"{item}.down_proj"]] if isinstance(item, str) else [item])
    made = {o.name for o in planned}
    for name, shape in expected.items():
        if name not in made:
            raise ConversionError(f"SRC lacks tensor {name}, which its config implies (shape {list(shape)})")
    return planned
