"""The write sequence `convert`, `extend` and `export` share (docs/architecture.md, "The conversion pipeline").

    resolve SRC, check DST --> read, check, plan (the command's `prepare`) --> the memory budget
        --> check finite --> staging folder: shards, config and code, side files, card, verify --> DST

A command says only what differs: how it reads SRC and plans the outputs
(`prepare`, which returns a `ConversionPlan`), and how it writes its config, card and
verification. The memory budget the verification runs within (`--max-memory`) is resolved and
checked here, once, for every command. Everything that can be wrong with SRC, and a budget too
small for the verification, is found before the staging folder exists; DST appears only when the
folder is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..hub.gguf import GGUFError, dequantized, gguf_file, read_info
from ..hub.provenance import read_provenance, record_commit
from ..memory.budget import MemoryBudget
from .errors import ConversionError
from .folders import check_destination, staged_folder
from .sources import SourceCheckpoint, resolve_source
from .verify import check_budget
from .writer import OutputTensor, copy_side_files, output_size, write_sharded


@dataclass
class Result:
    dst: Path
    shards: list[str]
    max_abs_diff: float | None = None  # None when not verified


@dataclass
class Verification:
    """How a command checks what it wrote, within the memory budget."""

    config: object  # the larger of the two models it runs: the budget must hold its largest layer
    dtype: torch.dtype  # the dtype it runs in
    run: Callable[..., float]  # run(the staging folder, budget=the budget) -> max |logits difference|


@dataclass
class ConversionPlan:
    """What one command writes, planned and checked: everything the staged write needs."""

    ckpt: SourceCheckpoint
    outputs: list[OutputTensor]
    announce: str  # the line logged before writing starts
    desc: str  # the progress bar's label
    write_config: Callable[[Path], None]  # config.json (and remote code) into the staging folder
    write_card: Callable[..., None]  # write_card(stage, source=the source's `Provenance`): the model card
    verification: Verification | None  # None: nothing can run SRC to compare with (the plan's `done` says so)
    finite: Iterable[str] | None = None  # source tensors to scan for inf/NaN; None: those the outputs read
    done: list[str] = field(default_factory=list)  # lines logged after DST is in place, before "wrote DST"


def run(
    src: str,
    dst: str | Path,
    prepare: Callable[[Path, Path], ConversionPlan],
    *,
    verify: bool,
    max_memory: int | None,
    overwrite: bool,
    max_shard_size: int | str,
    revision: str | None,
    log,
    allow_pickle: bool = False,
    count_shards: bool = False,
    takes_gguf: bool = False,
    dequantize_to=None,
) -> Result:
    """Resolve SRC, check DST, plan with `prepare(folder, dst)`, then write DST whole or not at all; with
    `verify`, check it within `max_memory` bytes (None: the memory free when the check is planned).

    A GGUF SRC (a `.gguf` file, or a folder holding one and no config.json) is dequantized by transformers'
    GGUF loader into a hidden folder beside DST (`dequantize_to`, default float32), read from there like any
    checkpoint and removed at the end; a command that reads only gated checkpoints (`takes_gguf` False)
    refuses it before anything is read, since a GGUF never holds one.
    """
    steps = dict(src=src, verify=verify, max_memory=max_memory, overwrite=overwrite, max_shard_size=max_shard_size,
                 log=log, count_shards=count_shards)  # fmt: skip
    try:
        gguf = gguf_file(src)
        if gguf is None:
            return _run(resolve_source(src, revision=revision, allow_pickle=allow_pickle), dst, prepare, **steps)
        info = read_info(gguf)
        if not takes_gguf:
            raise ConversionError(f"SRC {src} is a {info.architecture} GGUF file, not a gated checkpoint: convert "
                                  "it first (gated-attention convert SRC DST)")
        check_destination(Path(src).expanduser(), Path(dst), overwrite)
        log(f"reading {info.describe()} with transformers' GGUF loader")
        with dequantized(gguf, near=Path(dst).expanduser(), dtype=dequantize_to) as folder:
            return _run(folder, dst, prepare, **steps)
    except GGUFError as e:
        raise ConversionError(f"SRC {e}") from None


def _cast_reserve(plan: ConversionPlan) -> int:
    """The most a tensor stored in another dtype than the verification runs in holds beside its cast: its stored
    bytes, mapped from the file while it is read (SRC's tensors, and DST's where DST keeps SRC's dtype). The
    write holds no more beside the largest layer: one tensor, its source beside its cast."""
    run = plan.verification.dtype
    stored = [(info.dtype, info.nbytes) for info in plan.ckpt.tensors.values()]
    stored += [(o.dtype, o.nbytes) for o in plan.outputs]
    return max((n for dtype, n in stored if dtype.is_floating_point and dtype != run), default=0)


def _run(folder: Path, dst, prepare, *, src, verify, max_memory, overwrite, max_shard_size, log, count_shards) -> Result:
    dst = Path(dst)
    check_destination(folder, dst, overwrite)
    plan = prepare(folder, dst)
    source = read_provenance(src, folder)  # base model, commit and license, for the card and config.json
    budget = None
    if verify and plan.verification is not None:
        # Resolved once: the check before writing and the verification after it work with the same number.
        budget = MemoryBudget.resolve(max_memory)
        budget.rehearse(plan.verification.dtype)
        check_budget(budget, plan.verification.config, plan.verification.dtype, _cast_reserve(plan))
    # Also with --no-verify: an inf or NaN in SRC is refused before anything is written.
    plan.ckpt.check_finite(plan.finite if plan.finite is not None else (name for o in plan.outputs for name in o.sources))

    log(plan.announce)
    result = Result(dst, [])
    with staged_folder(dst, overwrite, log, size=output_size(plan.outputs, folder)) as stage:
        result.shards = write_sharded(stage, plan.outputs, max_shard_size=max_shard_size, desc=plan.desc)
        plan.write_config(stage)
        record_commit(stage, source.commit)
        copy_side_files(folder, stage)
        plan.write_card(stage, source=source)
        if budget is not None:
            result.max_abs_diff = plan.verification.run(stage, budget=budget)
    for line in plan.done:
        log(line)
    log(f"wrote {dst}" + (f" ({len(result.shards)} shard{'s' * (len(result.shards) > 1)})" if count_shards else ""))
    return result
