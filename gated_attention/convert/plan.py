"""The weight plan: every output tensor of a conversion, named, shaped and checked before a byte is written.

A plan starts as SRC's tensors, each an output under its own name (`Planned`). The family's rules
(`families.Family.rules`) then rewrite that list one after the other, in the record's order, each with
the same `apply(tensors, target)`: `Rename` and `RenameByLayerType` change names, `Split` cuts a fused
tensor into ours (`SplitRows` where the parts' rows interleave, as in the Gated Attention paper's q_proj),
`FuseExperts` joins per-expert tensors into one, and `AddGate` doubles an attention's
output projection and adds the gate before it (transformers' `conversion_mapping.py` declares its
renames, chunks and merges the same way). `plan_weights` applies the rules, checks every name and shape
against the target model's, and turns each `Planned` into the `OutputTensor` the writer makes.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from .sources import ConversionError, SourceCheckpoint, first_non_finite
from .writer import OutputTensor

GATE_BIAS_INIT = 10.0  # --init bias: sigmoid(10) = 0.9999546

# Buffers some older checkpoints carry that no model loads.
IGNORED_SOURCE_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")

# --- what the rules rewrite ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One output tensor as the rules see it: its name and shape, and what it is made of.

    SRC's tensors `sources`, their bytes one after the other (fused experts), or only `rows` of the one
    source (a `Split` part), times `scale` (a power of two: exact); with no sources, a new tensor whose
    every element is `fill`, or, with `identity`, the first rows of the identity matrix."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the source's (a new tensor: its neighbour's); `--dtype` applies after the rules
    sources: tuple[str, ...] = ()
    rows: slice | tuple[int, ...] | None = None  # a `Split` part's rows, or a `SplitRows` part's
    scale: float = 1.0
    fill: float | None = None
    identity: bool = False

    @property
    def origin(self) -> str:
        """The name an error gives it: the SRC tensor it comes from, or its own for a new one."""
        return self.sources[0] if self.sources else self.name


@dataclass(frozen=True)
class Target:
    """What a rule may read besides the tensors."""

    expected: dict[str, tuple[int, ...]]  # the target model's tensors and their shapes
    model_type: str  # the target's, for messages
    init: str  # "exact", "bias" (a conversion adds the gate), or "copy" (`extend`)
    source: object = None  # SRC's config (`RenameByLayerType` reads which layers are attention)


# --- the rules, declared per family (`families.FAMILIES`) ----------------------------------------------------


class Rule:
    """A weight rule: `apply` rewrites the plan's tensors; `key_mapping` is the same rule as transformers'
    `from_pretrained(key_mapping=...)` applies it while loading (a rule that changes more than names has none)."""

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        raise NotImplementedError

    def key_mapping(self, source, num_layers: int) -> dict[str, str]:
        raise ValueError(f"{type(self).__name__} changes tensors, not only names: transformers cannot apply it while loading")


@dataclass(frozen=True)
class Rename(Rule):
    """A source tensor under another name: `re.sub(pattern, replacement, name)` (transformers' `WeightRenaming`)."""

    pattern: str
    replacement: str

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        return [replace(t, name=re.sub(self.pattern, self.replacement, t.name)) for t in tensors]

    def key_mapping(self, source, num_layers: int) -> dict[str, str]:
        return {self.pattern: self.replacement}


@dataclass(frozen=True)
class RenameByLayerType(Rule):
    """`model.layers.N.<part>.` -> `<attention>` where the source's layer N is an attention layer, else `<linear>`
    (an fla hybrid keeps both kinds of mixer under `attn`; `source.attention_layers` says which is which)."""

    part: str
    attention: str
    linear: str

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        return [replace(t, name=self._renamed(t.name, target.source)) for t in tensors]

    def _renamed(self, name: str, source) -> str:
        m = re.match(rf"^model\.layers\.(\d+)\.{re.escape(self.part)}\.", name)
        if not m:
            return name
        return f"model.layers.{m[1]}.{self._mixer(int(m[1]), source)}." + name[m.end() :]

    def _mixer(self, layer: int, source) -> str:
        return self.attention if layer in source.attention_layers else self.linear

    def key_mapping(self, source, num_layers: int) -> dict[str, str]:
        return {rf"^model\.layers\.{n}\.{re.escape(self.part)}\.": f"model.layers.{n}.{self._mixer(n, source)}."
                for n in range(num_layers)}  # fmt: skip


@dataclass(frozen=True)
class Split(Rule):
    """One fused source tensor cut along dim 0 into consecutive target tensors, in row order (transformers'
    `Chunk`). Names are suffixes of the tensor name; each part's rows are the target model's shape for it,
    so the split needs no config field of its own."""

    source: str  # e.g. "self_attn.qkv_proj.weight"
    targets: tuple[str, ...]  # e.g. q_proj, k_proj, v_proj weights

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        planned = []
        for t in tensors:
            if not t.name.endswith("." + self.source):
                planned.append(t)
                continue
            stem = t.name.removesuffix(self.source)
            names = [stem + part for part in self.targets]
            for name in names:
                if name not in target.expected:
                    raise ConversionError(f"SRC has tensor {t.origin}, whose part {name} a {target.model_type} model "
                                          "with this config does not have")  # fmt: skip
            shapes = [target.expected[name] for name in names]
            _check_shape(t.origin, t.shape, (sum(s[0] for s in shapes), *shapes[0][1:]))
            start = 0
            for name, shape in zip(names, shapes):
                planned.append(replace(t, name=name, shape=shape, rows=slice(start, start + shape[0])))
                start += shape[0]
        return planned


@dataclass(frozen=True)
class SplitRows(Rule):
    """Source tensors whose rows are dealt out to several target tensors by a table the source config gives,
    weight and bias alike: the paper's q_proj, whose query and gate rows alternate per key/value group.
    `parts(source, name, rows)` is {target tensor: its rows, in order} for a tensor it deals out, None for one
    it leaves as it is, and raises ValueError naming what is wrong. The table is the source's own rule
    (`hub.paper_layout.PaperLayout.parts`), whose load-time form (`split_state`) is what `analyze` reads the
    paper's checkpoints with: transformers' `key_mapping` only renames, so this rule has none here."""

    parts: Callable[..., dict[str, list[int]] | None]

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        planned = []
        for t in tensors:
            try:
                parts = self.parts(target.source, t.name, t.shape[0])
            except ValueError as e:
                raise ConversionError(str(e)) from None
            if parts is None:
                planned.append(t)
                continue
            for name, rows in parts.items():
                planned.append(replace(t, name=name, shape=(len(rows), *t.shape[1:]), rows=tuple(rows)))
        return planned


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class FuseExperts(Rule):
    """Per-expert tensors (the layout transformers 5 still saves for Qwen3-MoE and Mixtral) fused into our
    MoE's in-memory layout: gate_up_proj [E, 2I, H] (expert e = gate_e rows then up_e rows), down_proj [E, H, I].
    The fused tensors take the place of the layer's first expert tensor."""

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        layers: dict[str, dict[int, dict[str, Planned]]] = {}  # prefix -> expert -> proj -> tensor
        planned: list[Planned | str] = []  # a str marks where a layer's fused experts go
        for t in tensors:
            m = _PER_EXPERT.match(t.name)
            if not m:
                planned.append(t)
                continue
            layer = layers.setdefault(m["prefix"], {})
            if not layer:
                planned.append(m["prefix"])
            layer.setdefault(int(m["expert"]), {})[m["proj"]] = t
        fused = {prefix: _fused(prefix, experts, target) for prefix, experts in layers.items()}
        return [p for item in planned for p in (fused[item] if isinstance(item, str) else [item])]


def _fused(prefix: str, experts: dict[int, dict[str, Planned]], target: Target) -> list[Planned]:
    """A layer's gate_up_proj and down_proj, each the experts' tensors one after the other."""
    ids = sorted(experts)
    if ids != list(range(len(ids))):
        raise ConversionError(f"SRC's experts under {prefix} are numbered {ids[:8]}..., not 0..{len(ids) - 1}")
    planned = []
    for name, projs in ((f"{prefix}.gate_up_proj", ("gate_proj", "up_proj")), (f"{prefix}.down_proj", ("down_proj",))):
        parts = []
        for e in ids:
            for proj in projs:
                if proj not in experts[e]:
                    raise ConversionError(f"SRC lacks tensor {prefix}.{e}.{proj}.weight (expert {e} is incomplete)")
                parts.append(experts[e][proj])
        if name not in target.expected:
            raise ConversionError(f"SRC has experts under {prefix}, which a model with this config does not have")
        rows, cols = parts[0].shape
        for part in parts:
            _check_shape(part.origin, part.shape, (rows, cols))
        _check_shape(f"{prefix}.*.{'/'.join(projs)} (fused)", (len(ids), rows * len(projs), cols), target.expected[name])
        sources = tuple(source for part in parts for source in part.sources)
        planned.append(Planned(name, target.expected[name], parts[0].dtype, sources))
    return planned


@dataclass(frozen=True)
class AddGate(Rule):
    """The gate a conversion adds to each attention: for every tensor named `*.{output}` (the projection that
    reads the gated output), a gate `*.{gate}` beside it (a weight, and a bias where the target has one), made
    unless SRC has it already, and, with `--init exact`, the projection doubled.

    Exact: weight 0 and bias 0, every score sigmoid(0) = 0.5, times 2 W = W. Bias: the projection as it is,
    bias `GATE_BIAS_INIT`. A low-rank gate's `up` is the weight above and its `down` the first rows of the
    identity (it reads the first `rank` channels), so `up`'s gradient is not 0 from the first step. The paths
    are suffixes (any module path a target model has, not only ours); the gate's shapes are the target model's."""

    output: str = "self_attn.o_proj.weight"
    gate: str = "self_attn.attn_gate"
    # False: the projection is shared with another attention whose rule doubles it (Zamba's attention block, one set
    # of weights called by several layers, each with a gate of its own)
    double: bool = True

    def apply(self, tensors: list[Planned], target: Target) -> list[Planned]:
        present = {t.name for t in tensors}
        bias = GATE_BIAS_INIT if target.init == "bias" else 0.0
        planned = []
        for t in tensors:
            if not (t.name == self.output or t.name.endswith("." + self.output)):
                planned.append(t)
                continue
            planned.append(replace(t, scale=t.scale * 2.0) if target.init == "exact" and self.double else t)
            prefix = t.name.removesuffix(self.output) + self.gate + "."
            for part, init in (("weight", {"fill": 0.0}), ("bias", {"fill": bias}), ("down.weight", {"identity": True}),
                               ("up.weight", {"fill": 0.0}), ("up.bias", {"fill": bias})):
                name = prefix + part
                if name in target.expected and name not in present:
                    planned.append(Planned(name, target.expected[name], t.dtype, **init))
        return planned

    def key_mapping(self, source, num_layers: int) -> dict[str, str]:
        return {}  # the gate is DST's alone: the ungated reference reads SRC's tensors as they are


def key_mapping(rules, source, num_layers: int) -> dict[str, str]:
    """The rules' renames as transformers' `from_pretrained(key_mapping=...)` applies them while loading (a
    regex and its replacement, `\\1` for its one group), so that a model reads SRC's files under our names."""
    mapping = {}
    for rule in rules:
        mapping.update(rule.key_mapping(source, num_layers))
    return mapping


# --- reading ---------------------------------------------------------------------------------------------


def _read(ckpt: SourceCheckpoint, name: str, dtype: torch.dtype, scale: float = 1.0,
          rows: slice | tuple[int, ...] | None = None) -> torch.Tensor:
    """Source tensor `name` (its `rows` only, for a `Split` or `SplitRows` part) in `dtype`, times `scale`."""
    source = t = ckpt.read(name) if rows is None else ckpt.read(name)[rows if isinstance(rows, slice) else list(rows)]
    if t.dtype != dtype:
        t = t.to(dtype)
    if scale != 1.0:
        # A power of two: exact in every float format. Out of place: writing into the file's private
        # mapping faults page by page (copy on write), much slower than a fresh product.
        t = t * scale
    if t is not source and (i := first_non_finite(t)) is not None:  # SRC is finite (checked): this made the inf
        value = source.reshape(-1)[i].item()
        where = [int(k) for k in np.unravel_index(i, source.shape)]
        if isinstance(rows, slice):
            where[0] += rows.start
        elif rows is not None:
            where[0] = rows[where[0]]
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]  # the only scale a rule sets is `AddGate`'s
        cause = (
            f"{str(dtype).removeprefix('torch.')} cannot hold it (--dtype)"
            if not torch.isfinite(source.reshape(-1)[i : i + 1].to(dtype)).all()
            else f"doubling {module} (--init exact) makes it inf; --init bias leaves {module} as it is"
        )
        raise ConversionError(f"SRC tensor {name} holds {value:g} at {where}: {cause}")
    return t


def _read_each(ckpt: SourceCheckpoint, names: tuple[str, ...], dtype: torch.dtype, scale: float = 1.0):
    for name in names:  # one expert matrix in memory at a time
        yield _read(ckpt, name, dtype, scale)


def _full(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


def _identity(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.eye(*shape, dtype=dtype)


def _out_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    return requested if requested is not None and source.is_floating_point else source


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ConversionError(f"tensor {name} has shape {list(got)} in SRC but its config implies {list(want)}")


def _output(t: Planned, ckpt: SourceCheckpoint, requested: torch.dtype | None) -> OutputTensor:
    """What the writer makes of a planned tensor: read, cut, cast and scaled one tensor at a time, or, for a
    safetensors tensor kept as it is, its bytes copied from file to file."""
    dtype = _out_dtype(t.dtype, requested)
    if t.identity:
        return OutputTensor(t.name, t.shape, dtype, partial(_identity, t.shape, dtype))
    if not t.sources:
        zeros = t.fill == 0.0 and math.copysign(1.0, t.fill) > 0
        return OutputTensor(t.name, t.shape, dtype, partial(_full, t.shape, dtype, t.fill), zeros=zeros)
    if len(t.sources) > 1:  # fused experts: SRC's model stacks them into fresh memory as it loads (writer.ALIGNMENT)
        make = partial(_read_each, ckpt, t.sources, dtype, t.scale)
        return OutputTensor(t.name, t.shape, dtype, make, list(t.sources), aligned=True)
    info = ckpt.tensors[t.sources[0]]
    unchanged = (ckpt.format == "safetensors" and dtype == info.dtype and t.scale == 1.0 and t.rows is None
                 and info.dequantize is None)
    make = partial(_read, ckpt, t.sources[0], dtype, t.scale, t.rows)
    return OutputTensor(t.name, t.shape, dtype, make, [t.sources[0]], copy_of=info if unchanged else None)


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

    `expected` is the target model's tensors and shapes (`shapes.target_shapes`, or `expected_shapes` of
    any model on the meta device): every name and shape is checked before anything is written. `rules` are
    the family's (`Rule`), applied in order; `source`, its source config, is what a rule may read.
    `config` is the target's (a transformers config: its `model_type` and `tie_word_embeddings`).
    A rule's new tensors follow the one they belong to (a gate its output projection), so they land in
    the same shard as the rest of the layer.
    """
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = [
        Planned(name, tuple(info.shape), info.dtype, (name,))
        for name, info in ckpt.tensors.items()
        # with tied embeddings the model uses embed_tokens for lm_head, as the source does
        if not (IGNORED_SOURCE_TENSORS.search(name) or (tied and name == "lm_head.weight"))
    ]
    target = Target(expected, config.model_type, init, source)
    for rule in rules:
        tensors = rule.apply(tensors, target)
    made: dict[str, Planned] = {}
    for t in tensors:
        if t.name in made:
            raise ConversionError(f"SRC tensors {made[t.name].origin} and {t.origin} would both be {t.name}")
        if t.name not in expected:
            raise ConversionError(f"SRC has tensor {t.origin}, which a {config.model_type} model with this config does not have")
        _check_shape(t.origin, t.shape, expected[t.name])
        made[t.name] = t
    for name, shape in expected.items():
        if name not in made:
            raise ConversionError(f"SRC lacks tensor {name}, which its config implies (shape {list(shape)})")
    return [_output(t, ckpt, dtype) for t in tensors]
