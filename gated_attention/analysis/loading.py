"""How `analyze` brings a MODEL into memory: transformers' own class, fla's models, accelerate's placement.

- `causal_lm_class`: the class to build MODEL with. A model type transformers ships is built with
  transformers' class, because importing fla registers fla's models under some of the same names
  (`mamba2`) with the Auto classes; a composite model's text model saved alone (Emu3, Mllama), with
  the transformers class its config names.
- `refuse_unreadable`: a class the analysis refuses (`recorded_outputs.REFUSED`) is one line before anything
  loads (a whole MusicGen checkpoint maps to its decoder, whose inputs are audio codes).
- `is_fla_model`: whether MODEL is one of flash-linear-attention's models, built inside `fla_torch_paths`
  (its attention layer cannot be built without flash-attn otherwise); fla is imported only for a model
  type nothing else knows.
- `paper_model`: one of the Gated Attention paper's released checkpoints (`hub.paper_layout`: Qwen3 with
  the gate inside q_proj, which no transformers class reads) in this package's model, read in memory as
  `convert` reads it, so that it gives the numbers of its converted folder; its own code is never run.
- `placement` and `loaded`: accelerate's big-model inference within the memory budget
  (`memory.budget`): the layers that fit stay in memory, the others are read from the checkpoint's
  files as they run, whole (`read_layers_whole`) and cast to the dtype asked for as they are read
  (`memory.budget.loading_dtype`); what running the model adds beside its weights is kept free
  (`running_memory`); a budget below one layer is refused before anything loads.

torch and transformers are imported inside the functions: the command line imports `DEVICE_MAPS` from
here while it builds its parser.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from .. import CLIError
from ..cli_common import first_line, format_size
from ..hub.paper_layout import is_paper_config

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placements


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What `loaded` needs to know of a command's flags: `analyze` gives its own (`from_args`), `stream` its
    window as `max_length`."""

    dtype: str = "float32"  # a torch dtype's name, or "auto" (the checkpoint's)
    device: str = "auto"
    device_map: str | None = None
    tokenizer: str | None = None  # a tokenizer other than MODEL's (a name in `loaded`'s `where`)
    trust_remote_code: bool = False
    max_length: int = 128  # tokens in the longest forward: what running the model reserves (`running_memory`)
    intervene: bool = False  # the interventions' extra logits are reserved too

    @classmethod
    def from_args(cls, args) -> LoadOptions:
        """The options from a parsed command line that has a flag for each field (`--intervene KIND`: any kind)."""
        values = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls)}
        return cls(**{**values, "intervene": bool(values["intervene"])})


def causal_lm_class(config: dict, trust_remote_code: bool):
    """transformers' own class for a model type it ships (None: the Auto classes decide).

    fla registers its models with the Auto classes under some of transformers' model types (`mamba2`):
    in a process that has imported fla, the Auto classes would build fla's model for a transformers
    checkpoint. A model type transformers ships is therefore built with transformers' class.
    """
    from ..modeling.recorded_outputs import transformers_classes

    if trust_remote_code and "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    return transformers_classes(model_type, config.get("architectures") or ()).get("AutoModelForCausalLM")


def refuse_unreadable(cls) -> None:
    """A class the analysis refuses (`recorded_outputs.REFUSED`, by the model type of the config it takes) is one line before
    anything loads. A full MusicGen checkpoint (model type "musicgen", a text-to-audio model whose weights lie under
    `decoder.`) maps to `MusicgenForCausalLM`, its decoder, whose inputs are audio codes: the refusal is that reason,
    not the missing weights its loading would report."""
    from ..modeling.recorded_outputs import REFUSED

    model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    if model_type in REFUSED:
        raise CLIError(f"{cls.__name__} cannot be analysed: {REFUSED[model_type]}")  # as `model_layout` says it


def is_fla_model(model_name: str, config: dict) -> bool:
    """Whether MODEL is one of flash-linear-attention's (fla) models, whose types fla registers on import.

    fla registers its model types (gla, retnet, hgrn, delta_net, gated_deltanet, ...) with the Auto
    classes when it is imported, `mamba`/`mamba2` among them over transformers' own: so it is imported
    only for a model type that neither transformers nor this package knows (and no remote code). Its
    models are built and run inside `fla_torch_paths()`: its attention layer cannot be built without
    flash-attn otherwise. Where fla is missing, such a type is one line naming the package.
    """
    import importlib.util

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if not model_type or model_type in CONFIG_MAPPING_NAMES or "auto_map" in config:
        return False
    if model_type not in CONFIG_MAPPING:
        if importlib.util.find_spec("fla") is None:
            raise CLIError(
                f"cannot load model {model_name!r}: transformers does not know its model type {model_type!r}, and "
                "flash-linear-attention, whose models register their types, is not installed "
                "(pip install flash-linear-attention)"
            )
        import fla  # noqa: F401 - registers fla's model types with the Auto classes
    return model_type in CONFIG_MAPPING and CONFIG_MAPPING[model_type].__module__.startswith("fla.")


def placement(options: LoadOptions) -> tuple[str | dict, bool]:
    """accelerate's device map for MODEL, and whether the GPUs take part (each gets what it has free)."""
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if options.device_map in DEVICE_MAPS:
        return options.device_map, torch.cuda.is_available()
    if options.device_map:
        return {"": options.device_map}, False
    if device in ("cpu", "cuda"):
        return "auto", device == "cuda"
    return {"": device}, False  # one named device: the model whole on it, as --device always did


def check_device(options: LoadOptions) -> None:
    """`--device` or `--device-map` naming a device this machine does not have is refused (torch would fail
    later, or accelerate place the model on the CPU without a word)."""
    import torch

    for flag, device in (("--device", options.device), ("--device-map", options.device_map)):
        if device is None or device in ("auto", "cpu") or device in DEVICE_MAPS:
            continue
        kind, _, index = device.partition(":")
        backend = getattr(torch, kind, None)
        available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
        if kind == "mps":
            available = torch.backends.mps.is_available()
        count = backend.device_count() if available and hasattr(backend, "device_count") else 1
        if not available:
            raise CLIError(f"{flag} {device}: torch finds no {kind} device on this machine; give --device cpu")
        if index and int(index) >= count:
            raise CLIError(f"{flag} {device}: this machine has {count} {kind} device(s), numbered from 0")


BUDGET_REMEDY = "give a larger --max-memory, a smaller --max-length, or free some memory; nothing was written"


@contextlib.contextmanager
def loaded(options: LoadOptions, model_name: str, where: dict[str, str], budget, offload_dir: Path) -> Iterator[tuple]:
    """MODEL and its tokenizer, placed by accelerate within `budget` (the layers that do not fit stay in the
    checkpoint's files and are read as they run), for as long as the block runs. The offload folder (for
    what transformers must rewrite) is made in `offload_dir`, on the output's disk, and removed after.

    A GGUF MODEL (a `.gguf` file, or a folder holding one) is first dequantized by transformers' GGUF loader
    into a folder in `offload_dir` (`hub.gguf`), in `--dtype`, and loaded from there like any checkpoint. That
    loader holds the whole model: a `--max-memory` below it is refused before it runs."""
    from ..hub.gguf import GGUFError, dequantized, dequantized_size, gguf_file, read_info
    from ..memory.budget import process_memory

    files = contextlib.ExitStack()  # a GGUF MODEL's dequantized folder, removed when the block ends
    try:
        if (file := gguf_file(where[model_name])) is not None:
            import torch

            print(f"{model_name}: reading {read_info(file).describe()} with transformers' GGUF loader")
            dtype = None if options.dtype == "auto" else getattr(torch, options.dtype)
            if budget.given and (size := dequantized_size(file, dtype)) + (held := process_memory()) > budget.limit:
                raise CLIError(f"MODEL {model_name}: transformers' GGUF loader holds the whole model in memory to "
                               f"dequantize it ({format_size(size)} in {str(dtype or torch.float32).removeprefix('torch.')}"
                               f"), and this process holds {format_size(held)} already: above --max-memory "
                               f"{format_size(budget.limit)}; give a larger --max-memory; nothing was written")
            folder = files.enter_context(dequantized(file, near=offload_dir / file.name, dtype=dtype))
            where = {**where, model_name: str(folder)}
    except GGUFError as e:
        raise CLIError(f"MODEL {e}") from None
    with files, _loaded(options, model_name, where, budget, offload_dir) as pair:
        yield pair


@contextlib.contextmanager
def _loaded(options: LoadOptions, model_name: str, where: dict[str, str], budget, offload_dir: Path) -> Iterator[tuple]:
    import torch
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from .. import register_auto_classes
    from ..hub.loading import from_pretrained_checked
    from ..fla_cpu import fla_torch_paths
    from ..memory.budget import (MemoryBudgetError, cast_placement, cast_weights, loading_dtype, read_layers_whole,
                                     running_dtypes)

    register_auto_classes()  # MODEL may be one of ours, loaded without remote code

    tokenizer_name = options.tokenizer or model_name
    dtype = options.dtype if options.dtype == "auto" else getattr(torch, options.dtype)
    try:
        config = PretrainedConfig.get_config_dict(where[model_name])[0]
    except Exception:  # noqa: BLE001 - from_pretrained below says what is wrong with the folder
        config = {}
    if is_paper_config(config):
        model = paper_model(model_name, Path(where[model_name]), config, dtype, options, budget)
        tokenizer = _tokenizer(options, where, tokenizer_name)
        print(f"{model_name}: the Gated Attention paper's checkpoint, read in memory: {_placement_line(model, budget)}")
        yield model.eval(), tokenizer
        return
    building = fla_torch_paths if is_fla_model(model_name, config) else contextlib.nullcontext
    cls = causal_lm_class(config, options.trust_remote_code) or AutoModelForCausalLM
    refuse_unreadable(cls)
    device_map, gpus = placement(options)
    load_dtype, reserve, skeleton = dtype, 0, None
    if device_map == {"": "cpu"} or isinstance(device_map, str):  # the CPU holds weights: within the budget
        skeleton = _skeleton(model_name, cls, where, dtype, options, building)
        reserve = running_memory(skeleton, config, options.max_length, options.intervene)
        budget.rehearse(skeleton.dtype, device="cuda:0" if gpus else "cpu", attention="eager", dir=offload_dir)
        budget.say_split(reserve)  # the first model's: a run says it once
    if budget.given and device_map == {"": "cpu"}:  # the model whole in memory: a budget below it cannot hold
        size = sum(p.numel() * p.element_size() for p in skeleton.parameters())
        if size > (room := budget.weights_room(reserve)):
            raise CLIError(f"MODEL {model_name}: --device-map cpu holds all {format_size(size)} of weights in memory, "
                           f"and --max-memory {format_size(budget.limit)} leaves {format_size(max(room, 0))} for them "
                           f"(running the model takes {format_size(budget.running_reserve(reserve))}, this process "
                           "holds the rest); drop --device-map (the layers that do not fit are then read from the "
                           "checkpoint as they run) "
                           "or give a larger --max-memory")
    if isinstance(device_map, str):  # accelerate places the layers: refuse a budget below one of them first
        try:
            budget.check_holds(skeleton, BUDGET_REMEDY, reserve)
        except MemoryBudgetError as e:
            raise CLIError(f"MODEL {model_name}: {e}") from None
        load_dtype = loading_dtype(skeleton, config, dtype, budget, reserve)
    cast = cast_placement(skeleton, load_dtype, dtype)
    dtypes = running_dtypes(skeleton) if load_dtype != dtype else None
    skeleton = None
    with budget.placement(device_map=device_map, gpus=gpus, dir=offload_dir, reserve=reserve, **cast) as place:
        if not isinstance(device_map, str):
            place = {"device_map": device_map}
        try:  # weights that do not fit the config (a random or dropped layer) are refused, not analysed
            with building():
                model = from_pretrained_checked(cls, where[model_name], dtype=load_dtype,
                                                trust_remote_code=options.trust_remote_code, **place)
        except Exception as e:  # noqa: BLE001 - any loading failure is one line for the user
            raise CLIError(f"cannot load model {model_name!r}: {first_line(e)}") from e
        if load_dtype != dtype:
            cast_weights(model, load_dtype, dtypes)
        read_layers_whole(model)
        tokenizer = _tokenizer(options, where, tokenizer_name)
        print(f"{model_name}: {_placement_line(model, budget)}")
        yield model.eval(), tokenizer


def _tokenizer(options: LoadOptions, where: dict[str, str], tokenizer_name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where[tokenizer_name], trust_remote_code=options.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot load a tokenizer from {tokenizer_name!r} (pass --tokenizer): {first_line(e)}") from e


def check_token_ids(model, largest: int, model_name: str) -> None:
    """A `ValueError` (one line) where token id `largest` has no row in the model's embedding: the tokenizer is not
    the model's (the embedding would raise IndexError)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = getattr(embedding, "num_embeddings", None)
    if vocabulary is not None and largest >= vocabulary:
        raise ValueError(f"MODEL {model_name}: the tokenizer gives token id {largest}, and the model's embedding has "
                         f"{vocabulary} rows: the tokenizer is not this model's (see --tokenizer)")


def paper_model(model_name: str, folder: Path, raw: dict, dtype, options: LoadOptions, budget):
    """One of the Gated Attention paper's checkpoints (`hub.paper_layout`) as a `GatedAttentionForCausalLM`,
    read whole into memory: the config as transformers' Qwen3 reads it, with the paper's flags as this
    package's fields, and q_proj's packed rows dealt out to q_proj and the gate, as `convert` does. Its
    safetensors are read as they are; a `--max-memory` below the weights is refused, since the model is whole in
    memory (convert it first to have its layers read from disk as they run)."""
    import inspect
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from ..configuration.gated_attention import GatedAttentionConfig
    from ..hub.loading import WeightsMismatch, from_pretrained_checked
    from ..hub.paper_layout import LayoutMismatch, PaperLayout, unsupported
    from ..hub.repo_ids import missing_weights
    from ..modeling.gated_attention import GatedAttentionForCausalLM

    if (reason := unsupported(raw)) is not None:
        raise CLIError(f"MODEL {model_name} is the Gated Attention paper's checkpoint, and cannot be read exactly: {reason}")
    layout = PaperLayout.from_config(raw)
    qwen3 = Qwen3Config.from_dict({k: v for k, v in raw.items() if k != "auto_map"})  # defaults, RoPE, window
    ours = inspect.get_annotations(GatedAttentionConfig)
    fields = {k: getattr(qwen3, k) for k in ours if k in qwen3.to_dict()}
    config = GatedAttentionConfig(**{**fields, **layout.target_fields(), "attn_gate": layout.gate_spec()})

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif (why := missing_weights(folder)) is not None:  # config.json alone: a download cut short, no pickle checkpoint
        raise CLIError(f"MODEL {model_name} is the Gated Attention paper's checkpoint, but its folder is not whole ({why}): "
                       "fetch it again with the network allowed")
    else:
        raise CLIError(f"MODEL {model_name} is the Gated Attention paper's checkpoint without safetensors weights: "
                       "convert it first (gated-attention convert --allow-pickle SRC DST) and give DST as MODEL")
    if dtype == "auto":
        stored = raw.get("dtype") or raw.get("torch_dtype")
        dtype = getattr(torch, stored) if isinstance(stored, str) and hasattr(torch, stored) else torch.float32
    size = sum(f.stat().st_size for f in files) * dtype.itemsize // max(_stored_itemsize(raw), 1)
    if budget.given and size > (room := budget.weights_room(0)):
        raise CLIError(f"MODEL {model_name}: the paper's checkpoint is read whole into memory ({format_size(size)} of "
                       f"weights), and --max-memory {format_size(budget.limit)} leaves {format_size(max(room, 0))}; "
                       "give a larger --max-memory, or convert it first (its layers are then read from disk as they run)")
    try:
        state = layout.split_state(item for file in files for item in load_file(file).items())
    except LayoutMismatch as e:
        raise CLIError(f"cannot load model {model_name!r}: {e}") from None
    try:
        model = from_pretrained_checked(GatedAttentionForCausalLM, None, config=config, state_dict=state, dtype=dtype)
    except WeightsMismatch as e:
        raise CLIError(f"cannot load model {model_name!r}: {e}") from None
    device, _ = placement(options)
    if isinstance(device, dict):
        model.to(device[""])
    elif torch.cuda.is_available():
        model.to("cuda")
    return model


def _stored_itemsize(raw: dict) -> int:
    import torch

    stored = raw.get("dtype") or raw.get("torch_dtype")
    return getattr(torch, stored).itemsize if isinstance(stored, str) and hasattr(torch, stored) else 4


def running_memory(skeleton, config: dict, max_length: int, intervene: bool) -> int:
    """What running MODEL adds to memory beside its weights, in bytes (an upper bound), for `--max-memory` to
    hold it too.

    - Reading a weight stored in another dtype than the model runs in (`reading_reserve`).
    - One layer's forward on an input of `max_length` tokens (inputs run one at a time): eager attention's
      `[H, T, T]` scores, scaled, masked and cast back in the model's dtype, the softmax in float32 and the
      capture's float64 sum of each key's attention; the MLP's activations; the logits (the last position's,
      or every position's three times and in float32 for the loss with `--intervene`).
    """
    from ..memory.budget import reading_reserve

    text = skeleton.config.get_text_config()
    hidden = _first_int(getattr(text, "hidden_size", None), 0)
    heads = _first_int(getattr(text, "num_attention_heads", None), max(hidden // 64, 1))
    intermediate = _first_int(getattr(text, "intermediate_size", None), 4 * hidden)
    vocab = _first_int(getattr(text, "vocab_size", None), 0)
    size = skeleton.dtype.itemsize
    tokens = max_length

    reading = reading_reserve(skeleton, config.get("dtype") or config.get("torch_dtype"))
    attention = heads * tokens * tokens * (4 * size + 4 + 8)
    mlp = tokens * (3 * intermediate + 4 * hidden) * size
    logits = 3 * tokens * vocab * (size + 4) if intervene else vocab * 4
    return reading + attention + mlp + logits


def _first_int(value, default: int) -> int:
    """A config size that some configs give per layer (Gemma 3n's `intermediate_size`): the largest."""
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and value > 0 else default


def _placement_line(model, budget) -> str:
    sizes = [(p.numel() * p.element_size(), p.device.type) for p in model.parameters()]
    total, on_disk = sum(n for n, _ in sizes), sum(n for n, device in sizes if device == "meta")
    devices = sorted({device for _, device in sizes if device != "meta"})
    where = f"on {', '.join(devices)}" if devices else ""
    if not on_disk:
        return f"all {format_size(total)} of weights {where}"
    rest = f", the rest {where}" if devices else ""
    return (f"{format_size(on_disk)} of {format_size(total)} of weights read from the checkpoint as it runs{rest}; "
            f"budget {budget.describe()}")


def _skeleton(model_name: str, cls, where: dict[str, str], dtype, options: LoadOptions, building):
    """MODEL on the meta device (shapes and dtypes, no memory), or a `CLIError`."""
    import torch

    try:
        with building(), torch.device("meta"):
            return _model_from_config(cls, where[model_name], dtype, options.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot load model {model_name!r}: {first_line(e)}") from e


def _model_from_config(cls, where: str, dtype, trust_remote_code: bool):
    """MODEL built from its config alone (on the meta device, inside the caller's `torch.device`)."""
    from transformers import AutoConfig

    if hasattr(cls, "from_config"):  # an Auto class
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
        return cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return cls._from_config(cls.config_class.from_pretrained(where), dtype=dtype)
