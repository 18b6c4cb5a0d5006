"""Writing a converted checkpoint into its staging folder (`folders.staged_folder`): streamed safetensors shards, side files.

Shards are planned with huggingface_hub's sharding helper from names, shapes
and dtypes only, and then written one tensor at a time: the safetensors header
is known from the plan, so each tensor is produced, written and freed before
the next one is read.

A tensor marked `aligned` (experts fused from SRC's per-expert tensors) starts
at a 64-byte boundary of its file (`ALIGNMENT`). transformers' loader maps the
file and uses a tensor where it lies, and torch's CPU kernels for one row
(gemv; grouped_mm's group of one token) round by the weight's alignment: an
expert 8 bytes past a 16-byte boundary gives other bits than one where torch
allocates. SRC's per-expert tensors are stacked into freshly allocated
(64-byte aligned) memory as they load, so DST's fused ones must lie aligned
to give their bits. The other tensors keep their planned order, as SRC's
keep theirs (where SRC's model uses them mapped, at SRC's offsets).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import constants, split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from .sources import TORCH_TO_SAFETENSORS, ConversionError, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
ALIGNMENT = 64  # bytes: torch's CPU allocator's (c10's gAlignment), see the module docstring
# Files copied from SRC unchanged: tokenizer, chat template, generation defaults, license.
SIDE_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
    "preprocessor_config.json",
    "LICENSE*",
    "NOTICE*",
)


@dataclass
class OutputTensor:
    """One tensor of the output: its final name, shape and dtype, and how to make it.

    `make()` returns the tensor, or an iterable of tensors whose bytes, in
    order, are the tensor's (so a fused `[E, ...]` tensor can be written one
    expert at a time). A tensor that is a safetensors source tensor byte for
    byte (same name aside, same dtype, no arithmetic) also has `copy_of`, and
    its bytes go from file to file without passing through Python. A tensor
    of zeros (`zeros`, the exact gate init) is written from a buffer of zeros,
    without being made (never left as a hole: see `_write_zeros`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor | Iterable[torch.Tensor]]
    sources: list[str] = field(default_factory=list)  # source tensor names, for ordering and messages
    copy_of: TensorInfo | None = None
    zeros: bool = False  # every byte is zero
    aligned: bool = False  # starts at an ALIGNMENT boundary of its file (see the module docstring)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --- shards ---------------------------------------------------------------------------------------


def _aligned_order(tensors: list[OutputTensor]) -> list[OutputTensor]:
    """The `aligned` tensors first, those whose sizes keep the next one on an `ALIGNMENT` boundary before the
    others, then the rest in their planned order: the format leaves no room between tensors."""
    return sorted(tensors, key=lambda t: (not t.aligned, t.aligned and t.nbytes % ALIGNMENT != 0))


def _header(tensors: list[OutputTensor]) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces (as the format allows) to 8 bytes, or, when a
    tensor is `aligned`, so that the data that follows starts on an `ALIGNMENT` boundary."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": TORCH_TO_SAFETENSORS[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % (ALIGNMENT if any(t.aligned for t in tensors) else 8))
    return struct.pack("<Q", len(raw)) + raw


def _write_all(out, data) -> None:
    """`out.write` on an unbuffered file may write less than asked (at most ~2 GiB per call on Linux)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[out.write(view) :]


def _copy_bytes(info: TensorInfo, out) -> None:
    """Append a source tensor's bytes to the unbuffered file `out`.

    `os.copy_file_range` lets the kernel move the bytes (page cache to page
    cache, or a reflink), which is most of a conversion's weights; where it
    is missing or refuses (not Linux, some file systems), plain reads.
    """
    offset, left = info.begin, info.nbytes
    with open(info.file, "rb", buffering=0) as src:
        while left:
            try:
                n = os.copy_file_range(src.fileno(), out.fileno(), left, offset)
            except (AttributeError, OSError):
                n = 0
            if n == 0:
                break
            offset, left = offset + n, left - n
        while left:
            chunk = os.pread(src.fileno(), min(left, 64 * 2**20), offset)
            if not chunk:
                raise ConversionError(f"{info.file.name} ended while copying tensor {info.name}")
            _write_all(out, chunk)
            offset, left = offset + len(chunk), left - len(chunk)


def write_safetensors(path: Path, tensors: list[OutputTensor], progress: tqdm | None = None) -> None:
    """Write one safetensors file, making and freeing one tensor at a time, `aligned` ones first."""
    tensors = _aligned_order(tensors)
    with open(path, "wb", buffering=0) as f:  # unbuffered: _copy_bytes appends at the file's own offset
        _write_all(f, _header(tensors))
        for spec in tensors:
            if spec.zeros:
                _write_zeros(f, spec.nbytes)
            elif spec.copy_of is not None:
                _copy_bytes(spec.copy_of, f)
            else:
                _write_made(f, spec)
            if progress is not None:
                progress.update(spec.nbytes)


_ZEROS = bytes(2**20)


def _write_zeros(out, n: int) -> None:
    """Zeros written, not left as a hole: a hole takes no room until it is read back through mmap (verify,
    any loader), and on a file system that filled up meanwhile (tmpfs) that read is a SIGBUS, which kills
    the process without a word. Written, a full file system is an ENOSPC here, which can be answered."""
    while n:
        chunk = min(n, len(_ZEROS))
        _write_all(out, memoryview(_ZEROS)[:chunk])
        n -= chunk


def _write_made(f, spec: OutputTensor) -> None:
    made = spec.make()
    if isinstance(made, torch.Tensor):
        if tuple(made.shape) != spec.shape:
            raise AssertionError(f"{spec.name}: made shape {list(made.shape)}, planned {list(spec.shape)}")
        made = (made,)
    written = 0
    for chunk in made:  # a tensor, or its leading-dimension slices in order (fused MoE experts)
        if chunk.dtype != spec.dtype:
            raise AssertionError(f"{spec.name}: made {chunk.dtype}, planned {spec.dtype}")
        _write_all(f, chunk.contiguous().reshape(-1).view(torch.uint8).numpy())
        written += chunk.numel() * chunk.element_size()
        del chunk
    if written != spec.nbytes:
        raise AssertionError(f"{spec.name}: made {written} bytes, planned {spec.nbytes}")


def write_sharded(
    folder: Path, tensors: list[OutputTensor], *, max_shard_size: int | str = "5GB", desc: str = "writing"
) -> list[str]:
    """Plan shards with huggingface_hub, write them, and write the index if sharded.

    The plan is `split_torch_state_dict_into_shards`'s, made by the factory under it with the planned
    sizes: the torch variant asks each tensor whether it is a DTensor, and that import alone
    (torch.distributed.tensor) costs a second, a third of what `convert --no-verify` imports.
    """
    by_name = {t.name: t for t in tensors}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    total = sum(t.nbytes for t in tensors)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None) as bar:
        for filename, names in split.filename_to_tensors.items():
            write_safetensors(folder / filename, [by_name[n] for n in names], bar)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return list(split.filename_to_tensors)


# What a DST holds besides weights and side files (config, generation config, index, model card, the
# remote-code bundle: some 200 kB), with room to spare, for the free-space check.
OTHER_FILES_BYTES = 4 * 2**20


def output_size(tensors: list[OutputTensor], src: Path) -> int:
    """Bytes a DST of these tensors takes, about: the weights (and their headers), SRC's side files, the rest."""
    headers = sum(256 + len(t.name) for t in tensors)  # a header entry per tensor, generously
    side = sum(p.stat().st_size for pattern in SIDE_FILE_PATTERNS for p in src.glob(pattern) if p.is_file())
    return sum(t.nbytes for t in tensors) + headers + side + OTHER_FILES_BYTES


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer files, generation config and license files from SRC."""
    copied = []
    for pattern in SIDE_FILE_PATTERNS:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and not (dst / path.name).exists():
                shutil.copyfile(path, dst / path.name)
                copied.append(path.name)
    return copied
