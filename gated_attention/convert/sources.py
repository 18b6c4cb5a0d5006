"""Reading source checkpoints: a local folder or a Hub repo id, one tensor at a time.

A checkpoint is a folder with `config.json` and weights as safetensors (one file
or shards listed in `model.safetensors.index.json`) or, only with
`allow_pickle`, PyTorch pickles (`pytorch_model*.bin`, read with
`torch.load(weights_only=True, mmap=True)`).

Safetensors tensors are mapped one at a time, each with its own private
mapping that goes away with the tensor: a mapped page counts towards the
process's resident memory while it is mapped, so mapping whole shards (as
`safe_open` does) would keep a shard resident. Here only the tensor being
converted is. Every header is checked before any
output is written, so a truncated or corrupted shard is refused up front.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..configuration.validation import ConfigError, check_architecture
from ..hub.repo_ids import HubUnavailable, cached_or_downloaded
from .errors import ConversionError
from .folders import check_source

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

# safetensors dtype codes <-> torch dtypes (the format's own table)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

_MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one source tensor lives: file, dtype, shape and (safetensors) byte range."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0  # absolute file offsets of the data (safetensors only)
    end: int = 0
    # A quantized source's weight (`quantized.dequantized_view`): made by `dequantize(*parts)` from the stored tensors
    # `parts`, in `dtype`; its file and offsets are its first part's.
    parts: tuple = ()
    dequantize: Callable | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# --- resolving SRC ------------------------------------------------------------------------------


def resolve_source(src: str, *, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """A local folder, or a Hub repo id resolved through huggingface_hub's cache.

    A cached repo resolves without any network access (`local_files_only=True`
    first), so conversion works offline once the files are cached.
    """
    check_source(src, revision)
    path = Path(src).expanduser()
    if path.exists():
        return path.resolve()

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*", "LICENSE*",
                "README.md"]  # the card names the license (`hub.provenance`)
    if allow_pickle:
        patterns.append("*.bin")
    try:
        return cached_or_downloaded(src, revision=revision, allow_patterns=patterns)
    except HubUnavailable as e:
        raise ConversionError(f"SRC {src}: no such folder, and {e}") from None


def read_config_dict(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"SRC {folder} has no config.json; is it a transformers checkpoint folder?")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"SRC {folder}/config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"SRC {folder}/config.json does not hold a JSON object")
    try:  # before any plan or model is built from it: a million layers would take minutes to be refused
        check_architecture(config, "SRC config.json")
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    return config


def _pickle_refusal(file: Path, error: Exception) -> str:
    """One line of our own for a pickle that torch.load(weights_only=True) refused. Torch's own text is
    several lines and ends in the advice to load with weights_only=False, which runs whatever the file says."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found:
        why = f"it names {found[1]}, which is neither a tensor nor a plain container (loading it would run code)"
    else:  # torch's lines, less its advice
        lines = [line.strip() for line in str(error).splitlines()
                 if line.strip() and "weights_only" not in line and "Weights only load failed" not in line]
        why = lines[0] if lines else type(error).__name__
    return (f"{file.name} was refused by torch.load(weights_only=True): {why}; it was not loaded. Use a checkpoint "
            "with safetensors weights, or re-save this one from a source you trust")


# --- safetensors headers -----------------------------------------------------------------------


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header; every tensor must lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{file.name} is truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise ConversionError(f"{file.name} is truncated or corrupted: its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConversionError(f"{file.name} is corrupted: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{file.name} is corrupted: its safetensors header is not a JSON object")
    data_start = 8 + n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConversionError(f"{file.name} is corrupted or uses an unsupported dtype (tensor {name})") from None
        info = TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)
        if end - begin != info.nbytes or begin < 0:
            raise ConversionError(f"{file.name} is corrupted: tensor {name} has {end - begin} bytes for shape {list(shape)}")
        if info.end > size:
            raise ConversionError(
                f"{file.name} is truncated: tensor {name} ends at byte {info.end}, the file has {size} bytes"
            )
        infos[name] = info
    return infos


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One safetensors tensor, mapped from the file on its own.

    The mapping covers this tensor only and is private (copy-on-write), so
    in-place arithmetic never reaches the file, and it is unmapped as soon as
    the tensor is freed: resident memory holds one tensor, not a shard. Pages
    come straight from the page cache, without a copy into fresh memory.
    """
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    start = info.begin - info.begin % mmap.ALLOCATIONGRANULARITY
    with open(info.file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), info.end - start, access=mmap.ACCESS_COPY, offset=start)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.begin - start)
    return raw.view(info.dtype).view(info.shape)  # keeps `mapped` alive exactly as long as it is used


# --- inf and NaN ---------------------------------------------------------------------------------

# A float is inf or NaN exactly when its exponent bits are all ones. Shifted left by one bit (the sign
# drops out), its bits read as an unsigned integer are then at least the all-ones exponent moved to the
# top: one shift and one max per chunk. float8_e4m3fn has no inf, and NaN only as S.1111.111: 0xFE shifted.
# In numpy, over the raw bits: far faster than torch.isfinite(t).all() (benchmarks/RESULTS.md, "Start-up time
# and conversion speed").
_NON_FINITE_FROM = {
    torch.float64: np.uint64(0xFFE0_0000_0000_0000),
    torch.float32: np.uint32(0xFF00_0000),
    torch.float16: np.uint16(0xF800),
    torch.bfloat16: np.uint16(0xFF00),
    torch.float8_e5m2: np.uint8(0xF8),
    torch.float8_e4m3fn: np.uint8(0xFE),
}
_CHECK_CHUNK = 1 << 18  # elements per step: the shifted copy stays in the CPU's cache for the max


def first_non_finite(t: torch.Tensor) -> int | None:
    """Flat index of the first inf or NaN in `t`; None if there is none (or `t` holds no floats)."""
    threshold = _NON_FINITE_FROM.get(t.dtype)
    if threshold is None:
        return None
    bits = t.reshape(-1).view(torch.uint8).numpy().view(threshold.dtype)
    buffer = np.empty(min(_CHECK_CHUNK, bits.size), threshold.dtype)
    for start in range(0, bits.size, _CHECK_CHUNK):
        chunk = bits[start : start + _CHECK_CHUNK]
        shifted = np.left_shift(chunk, 1, out=buffer[: chunk.size])
        if shifted.max() >= threshold:
            return start + int(np.flatnonzero(shifted >= threshold)[0])
    return None


# --- the checkpoint ------------------------------------------------------------------------------


class SourceCheckpoint:
    """The weights of a checkpoint folder: names, shapes and dtypes up front; data on demand."""

    def __init__(self, folder: Path, *, allow_pickle: bool = False, quantization: dict | None = None,
                 dequantize_to: torch.dtype = torch.float32):
        """`quantization`: SRC's `quantization_config`, whose quantized weights are read dequantized to
        `dequantize_to` (`quantized.py`)."""
        self.folder = folder
        self.format, files = self._weight_files(folder, allow_pickle)
        self.tensors: dict[str, TensorInfo] = {}
        self._pickle_file: Path | None = None
        self._pickle_state: dict[str, torch.Tensor] | None = None
        for file in files:
            infos = read_safetensors_header(file) if self.format == "safetensors" else self._pickle_infos(file)
            for name, info in infos.items():
                if name in self.tensors:
                    raise ConversionError(f"tensor {name} appears in both {self.tensors[name].file.name} and {file.name}")
                self.tensors[name] = info
        self.quantization = quantization
        if quantization is not None:
            from .quantized import dequantized_view

            self.tensors = dequantized_view(quantization, self.tensors, self._stored, dequantize_to)

    @staticmethod
    def _weight_files(folder: Path, allow_pickle: bool) -> tuple[str, list[Path]]:
        for fmt, index_name, single in (
            ("safetensors", SAFETENSORS_INDEX, SAFETENSORS_SINGLE),
            ("pickle", PICKLE_INDEX, PICKLE_SINGLE),
        ):
            index = folder / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                except (OSError, json.JSONDecodeError, KeyError, TypeError):
                    raise ConversionError(f"{index_name} in SRC is corrupted (no readable weight_map)") from None
                files = [folder / name for name in dict.fromkeys(weight_map.values())]
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise ConversionError(f"SRC is missing shard {missing[0]} listed in {index_name}")
            elif (folder / single).is_file():
                files = [folder / single]
            else:
                continue
            if fmt == "pickle" and not allow_pickle:
                raise ConversionError(
                    f"SRC has only pickle weights ({files[0].name}), which can run code when loaded; "
                    "pass --allow-pickle to read them with torch.load(weights_only=True)"
                )
            return fmt, files
        raise ConversionError(f"SRC {folder} has no weights (no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX} or {PICKLE_SINGLE})")

    def _load_pickle(self, file: Path) -> dict[str, torch.Tensor]:
        # Only one pickle file is mapped at a time; mmap keeps its tensors on disk until read.
        if self._pickle_file != file:
            self._pickle_state = None
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure is bad input
                raise ConversionError(_pickle_refusal(file, e)) from None
            if not isinstance(state, dict):
                raise ConversionError(f"{file.name} does not hold a state dict")
            self._pickle_file, self._pickle_state = file, state
        return self._pickle_state

    def _pickle_infos(self, file: Path) -> dict[str, TensorInfo]:
        state = self._load_pickle(file)
        return {
            name: TensorInfo(name, file, t.dtype, tuple(t.shape)) for name, t in state.items() if isinstance(t, torch.Tensor)
        }

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if info.dequantize is not None:
            return info.dequantize(*(self._stored(part) for part in info.parts))
        return self._stored(info)

    def _stored(self, info: TensorInfo) -> torch.Tensor:
        if self.format == "safetensors":
            return read_tensor(info)
        return self._load_pickle(info.file)[info.name].clone()

    def check_finite(self, names) -> None:
        """Refuse SRC if one of the tensors `names` holds an inf or NaN, naming the tensor and the element.

        Run before anything is written: a broken SRC would otherwise surface in the verification only, as an
        exact conversion that changed the logits, or, with `--no-verify`, not at all.
        """
        names = sorted(set(names), key=lambda n: (str(self.tensors[n].file), self.tensors[n].begin))  # read in file order
        total = sum(self.tensors[n].nbytes for n in names)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="checking SRC", disable=None) as bar:
            for name in names:
                info = self.tensors[name]
                if info.dtype in _NON_FINITE_FROM:
                    t = self.read(name)
                    if (i := first_non_finite(t)) is not None:
                        value = t.reshape(-1)[i].float().item()
                        where = [int(k) for k in np.unravel_index(i, info.shape)] if info.shape else []
                        raise ConversionError(
                            f"SRC tensor {name} holds {'NaN' if value != value else f'{value:g}'} at {where} "
                            f"({info.file.name}): the source checkpoint itself is broken; nothing was written"
                        )
                bar.update(info.nbytes)

    def files(self) -> list[Path]:
        return list(dict.fromkeys(info.file for info in self.tensors.values()))
