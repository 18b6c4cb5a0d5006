"""A memory budget for models larger than memory: accelerate's big-model inference, set up in one place.

`convert`, `extend` and `export` verify within a budget, and `analyze` runs within one:

- `MemoryBudget.resolve(size)`: its `limit`, `--max-memory SIZE` in bytes, or, without it, what the machine
  has free now (accelerate's own measure, psutil's available memory), remembering which of the two it is.
- `budget.rehearse(dtype)`: a miniature model loaded and run once before the process measures itself, so
  that what a first load and forward add to a process for good is counted in what it holds.
- `budget.weights_room(reserve)`: the bytes left for the model's weights: `--max-memory` less what this
  process holds already (`process_memory`), `reserve` (what running the model adds beside its weights) and
  `RUNTIME_SLACK` (what running adds that neither counts).
- `budget.say_split(reserve, log)`: that split as one line, said once for the budget (a command resolves one
  per run, however many models it loads), just before the first model loads.
- `budget.accelerate_max_memory()`: the `max_memory` dict that accelerate's `infer_auto_device_map` reads.
- `budget.placement()`: `from_pretrained`'s `device_map`, `max_memory` and `offload_folder`, with the
  offload folder a temporary directory that is removed on leaving, whatever happens.
- `reading_reserve(model, stored)`: what reading a weight stored in another dtype adds beside it.
- `loading_dtype`, `cast_placement`, `running_dtypes`, `cast_weights`: a model to run in another dtype than its
  checkpoint's (wider or narrower), loaded in the checkpoint's where layers stay on disk, placed by its cast
  sizes, and cast once loaded to the dtype transformers would have given each tensor.
- `largest_layer(model)` and `budget.check_holds(model, remedy)`: the largest block accelerate never
  splits (a decoder layer, or the embedding), and a one-line refusal of a budget smaller than it.
- `read_layers_whole(model)`: after loading, each layer read from disk is read whole as it starts, not
  module by module (code that reads a module's weights without calling it reads them too).
- `collect_if_alive(ref)`: after a model's last reference is dropped, free it where accelerate's hooks keep
  it alive.

How the budget bounds memory. `--max-memory` is the most the process may hold (its resident memory, at its
peak): what it holds before the model loads (Python, torch, the libraries: 0.3-0.5 GB; and, once
`rehearse` ran, what a first load and forward add for good: some 20 MB of kernels, thread pools and
allocator arenas on a CPU, a GPU's context), a reserve for running the model (the caller's estimate: a
layer's weights read in another dtype than they run in, the forward's working memory) and
`RUNTIME_SLACK` are taken off first (`weights_room`). accelerate keeps room in what is left for one largest layer
and fills the rest with whole layers, in order; the layers that do not fit stay on disk and are read during
the forward, then dropped (`AlignDevicesHook`). transformers points its offload index at the checkpoint's own
safetensors files, so nothing is copied; it writes into the offload folder only the tensors it changes while
loading (fused MoE experts) or reads from pickles. Freed layers go back to the system at once
(`return_freed_memory`), not into the allocator's free lists. Without `--max-memory` the budget is the
memory that was free when the command started, the reserve taken off it.

Imports: torch, accelerate and psutil inside the functions only, so that importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..cli_common import format_size


class MemoryBudgetError(ValueError):
    """A budget too small for one layer, as one line for the command to print."""


def process_memory() -> int:
    """Bytes this process holds now: its resident set (Python, torch, the libraries, what it has loaded)."""
    import psutil

    return psutil.Process().memory_info().rss


def return_freed_memory() -> None:
    """Make glibc give freed tensors of 1 MiB and more back to the system at once (its `M_MMAP_THRESHOLD`).

    glibc serves an allocation from its heap, which it keeps after a free, once the allocation is below a
    threshold that rises with every large block freed (up to 32 MiB): a model that reads its layers from disk
    as it runs frees a layer's tensors after each layer, and they then stay in the process. A 0.85B Llama
    analysed within 1 GB grew by 0.3 GB that way over three inputs. Fixing the threshold keeps large blocks
    out of the heap; small ones are unaffected. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3  # glibc's malloc.h
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc (macOS, musl): their allocators return large blocks anyway
        pass


def free_memory() -> int:
    """Bytes of memory the machine has free now, as accelerate's `get_max_memory` measures the CPU's."""
    import psutil

    return psutil.virtual_memory().available


# What running a model within `--max-memory` adds to the process beyond what it holds after `rehearse` and the
# callers' reserves count: kernels chosen for the real model's shapes, allocator arenas grown by its working
# memory, the model's Python objects and hooks, a tokenizer, the plots' drawing. Measured for `convert` and
# `analyze` in benchmarks/RESULTS.md ("Within the smallest budget a command accepts"), with room above that;
# tests/test_memory_peak.py checks the peak against the smallest budget each accepts.
RUNTIME_SLACK = 32 * 2**20


@dataclass(frozen=True)
class MemoryBudget:
    limit: int  # bytes: the most the process may hold (`--max-memory`), or the memory free when resolved
    given: bool  # True: `--max-memory`; False: the machine's free memory when it was resolved
    _said: list = field(default_factory=list, compare=False, repr=False)  # the split, once said (`say_split`)
    _rehearsed: set = field(default_factory=set, compare=False, repr=False)  # (dtype, device, attention) run

    @classmethod
    def resolve(cls, size: int | None) -> MemoryBudget:
        """The limit `size` from `--max-memory` (bytes), or what is free now when None.

        Measured once, when a command starts, so that the check before writing and the run after it
        work with the same number.
        """
        return cls(size, True) if size is not None else cls(free_memory(), False)

    def rehearse(self, dtype, *, device: str = "cpu", attention: str = "sdpa", dir: str | Path | None = None) -> None:
        """Load and run a miniature model once, the way the run's models will be, before the process measures
        itself for `--max-memory`: what a first load and forward add to a process and keep (modules imported on
        first use, torch's kernels paged in from its libraries, thread pools and their allocator arenas, a GPU's
        context) is then part of what `weights_room` takes off the limit instead of coming on top of it.

        The miniature is transformers' Llama, two layers 64 wide, saved as safetensors under `dir` and loaded by
        `from_pretrained` in `dtype` with accelerate's dispatch onto `device`, its second layer read from disk
        as it runs, then run on 16 tokens with `attention` (its weights returned for eager) and its hidden
        states, and freed. Freed blocks of 1 MiB and more go back to the system from then on
        (`return_freed_memory`), so that what the run makes and frees before a model loads (convert's write: its
        doubled projections and casts) does not stay in the process either.
        Once per dtype, device and attention; nothing for the default budget, which is the memory free beside the
        process, whatever it holds.
        """
        key = (str(dtype), str(device), attention)
        if not self.given or key in self._rehearsed:
            return
        self._rehearsed.add(key)
        return_freed_memory()
        import torch
        from safetensors.torch import save_file
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as transformers_logging

        config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        in_memory = ("model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb", "lm_head")
        device_map = {**{name: device for name in in_memory}, "model.layers.1": "disk"}
        bars = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        dispatch_log = logging.getLogger("accelerate.big_modeling")
        level = dispatch_log.level
        dispatch_log.setLevel(logging.ERROR)
        try:
            with tempfile.TemporaryDirectory(prefix=".rehearsal-", dir=dir) as folder, torch.no_grad():
                with torch.device("cpu"), torch.random.fork_rng(devices=[]):  # the caller's random state untouched
                    weights = LlamaForCausalLM(config).state_dict()
                save_file({k: v.contiguous() for k, v in weights.items()}, f"{folder}/model.safetensors",
                          metadata={"format": "pt"})  # fmt: skip
                config.save_pretrained(folder)
                del weights
                model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map,
                                                         offload_folder=folder, attn_implementation=attention)  # fmt: skip
                out = model(torch.arange(16, device=device)[None], output_hidden_states=True,
                            output_attentions=attention == "eager")  # fmt: skip
                # the float32 casts and reductions the callers run on the outputs
                (out.logits.float() - out.hidden_states[-1].float().sum()).abs().max().item()
                alive = weakref.ref(model)
                del model, out
                collect_if_alive(alive)
        finally:
            dispatch_log.setLevel(level)
            if bars:
                transformers_logging.enable_progress_bar()

    def describe(self) -> str:
        return f"{format_size(self.limit)} ({'--max-memory' if self.given else 'free memory; --max-memory to set it'})"

    def running_reserve(self, reserve: int = 0) -> int:
        """`reserve` (the caller's estimate of what running its model adds) and, for `--max-memory`, `RUNTIME_SLACK`."""
        return reserve + (RUNTIME_SLACK if self.given else 0)

    def weights_room(self, reserve: int = 0) -> int:
        """Bytes the model's weights may take in memory: the limit less the running reserve (`running_reserve`)
        and, for `--max-memory`, less what the process holds now (the free memory of the default was measured
        with that already taken). accelerate keeps one largest layer of it free."""
        return self.limit - self.running_reserve(reserve) - (process_memory() if self.given else 0)

    def split(self, reserve: int = 0) -> str:
        """How `--max-memory` is shared now, as one line: what this process holds, the running reserve, the
        weights' room."""
        held, running = process_memory(), self.running_reserve(reserve)
        return (f"--max-memory {format_size(self.limit)}: {format_size(held)} this process, {format_size(running)} "
                f"running reserve, {format_size(max(self.limit - held - running, 0))} for weights")

    def say_split(self, reserve: int = 0, log=print) -> None:
        """`log` the `split` the first time a model is about to load within `--max-memory` (nothing for the
        default budget: free memory, which the process's own was not taken from); the later loads of the
        run (convert's SRC, then DST) are not said again."""
        if self.given and not self._said:
            self._said.append(True)
            log(self.split(reserve))

    def accelerate_max_memory(self, *, gpus: bool = False, scale: float = 1.0, reserve: int = 0,
                              cast_largest: int = 0) -> dict:
        """accelerate's `max_memory`: the room for the weights on the CPU (`weights_room`), then disk for the
        rest (accelerate adds it).

        With `gpus`, every GPU also gets what it has free (accelerate's `get_max_memory`), so a model
        fills the GPUs first and the budget bounds only the host's memory. `scale`: each size times it, for
        a model loaded in another dtype than the one it will run in (`scale` = loaded bytes per weight /
        running bytes per weight: 0.5 widening bf16 to fp32, 2 narrowing fp32 to bf16, 1 for bf16 to fp16),
        and cast once loaded. Until that cast ends, the layers in memory are held in both dtypes (the loaded
        bytes are mapped from the checkpoint's file): given the largest layer in the running dtype
        (`cast_largest`), they get `room / (1 + scale)`, and accelerate's one layer beside them.
        """
        room = max(self.weights_room(reserve), 1)
        if cast_largest:
            room = min(room / (1 + scale) + cast_largest, room)
        sizes = {"cpu": room}
        if gpus:
            from accelerate.utils import get_max_memory

            sizes = {**{device: free for device, free in get_max_memory().items() if device != "cpu"}, **sizes}
        return {device: int(size * scale) for device, size in sizes.items()}

    @contextlib.contextmanager
    def placement(self, *, device_map: str | dict = "auto", gpus: bool = False, dir: str | Path | None = None,
                  scale: float = 1.0, reserve: int = 0, cast_largest: int = 0) -> Iterator[dict]:
        """`from_pretrained`'s keyword arguments that load a model within the budget, while inside.

        `device_map` is accelerate's (`"auto"`: fill the devices of `max_memory` in order, then disk). The
        offload folder is a new temporary directory under `dir` (the system's default when None), removed on
        leaving; a model loaded with these arguments must not be used after that. Give a `dir` on a disk
        when the system's temporary directory may be in memory (tmpfs). `scale`, `reserve`, `cast_largest`: see
        `accelerate_max_memory`.
        """
        # accelerate warns that "some parameters are on the meta device" whenever it offloads: here that is the
        # point, and the caller says how much stayed on disk.
        dispatch_log = logging.getLogger("accelerate.big_modeling")
        level = dispatch_log.level
        dispatch_log.setLevel(logging.ERROR)
        try:
            with tempfile.TemporaryDirectory(prefix=".offload-", dir=dir) as folder:
                if self.given:
                    return_freed_memory()
                max_memory = self.accelerate_max_memory(gpus=gpus, scale=scale, reserve=reserve,
                                                        cast_largest=cast_largest)  # fmt: skip
                yield {"device_map": device_map, "max_memory": max_memory, "offload_folder": folder}
        finally:
            dispatch_log.setLevel(level)

    def check_holds(self, model, remedy: str, reserve: int = 0) -> None:
        """Refuse the budget (`MemoryBudgetError`) when its room (`weights_room(reserve)`) cannot hold `model`'s
        largest layer.

        `model` may be on the meta device: only its shapes and dtypes are read. accelerate keeps that
        much room in memory for the layer being run, so a smaller budget would be exceeded by design.
        """
        name, size = largest_layer(model)
        held = process_memory() if self.given else 0
        running = self.running_reserve(reserve)
        if size + running + held <= self.limit:
            return
        budget = f"--max-memory {format_size(self.limit)} is" if self.given else f"only {format_size(self.limit)} of memory is free,"
        needs = f"{name} needs {format_size(size)} in {str(model.dtype).removeprefix('torch.')}"
        besides = [f"running the model {format_size(running)} more"] if running else []
        besides += [f"this process holds {format_size(held)} already (Python, torch and the libraries)"] if held else []
        if besides:
            needs += f", {' and '.join(besides)}"
        raise MemoryBudgetError(f"{budget} too small for one layer: {needs}; {remedy}")


def largest_layer(model) -> tuple[str, int]:
    """The name and size in bytes of the largest block accelerate places whole (`_no_split_modules`, or a
    module of its own such as the embedding): what one layer read from disk brings into memory."""
    from accelerate.utils import compute_module_sizes, get_max_layer_size

    sizes = compute_module_sizes(model)
    size, names = get_max_layer_size(list(model.named_children()), sizes, list(model._no_split_modules or []))
    return names[0], size


def reading_reserve(model, stored) -> int:
    """Bytes that reading one of `model`'s weights from a checkpoint stored in dtype `stored` adds beside the
    weight, at most: safetensors maps the stored bytes from the file (the process's memory while the tensor
    lives) and a cast to `model`'s dtype is made beside them, one tensor at a time. In the same dtype the
    mapped bytes are the weight itself: nothing beside it. `stored`: a dtype or its name (a config's `dtype`)."""
    import torch

    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if not (isinstance(stored, torch.dtype) and stored.is_floating_point) or stored == model.dtype:
        return 0
    return max((p.numel() for p in model.parameters()), default=0) * stored.itemsize


def loading_dtype(skeleton, config: dict, dtype, budget, reserve: int = 0):
    """The dtype to load a model in so that it runs in `dtype` within `budget`: the checkpoint's own where
    layers will be read from the checkpoint as they run and `dtype` is another, else `dtype`.

    transformers converts every tensor of a checkpoint to the dtype asked for as it loads, those it leaves
    on disk too: the whole checkpoint is read once and its pages count against the process (a bf16 0.85B
    Llama analysed in fp32 within 1 GB peaked at 2.84 GB; the same model stored in fp32 and verified in bf16
    within 1.5 GB, 4.32 GB). Loaded in the checkpoint's dtype, the tensors that stay on disk are not read at
    load; each is cast to `dtype` as its layer runs (accelerate casts a tensor it reads to the dtype of the
    parameter it fills, which `cast_weights` sets), and the layers in memory are cast once loaded. Wider
    (bf16 -> fp32) and narrower (fp32 -> bf16) alike: `cast_weights` gives each tensor the dtype transformers'
    own load in `dtype` gives it (`running_dtypes`), so the buffers a model computes in float32 whatever its
    dtype (RoPE's inv_freq) stay float32, and the bits are those of transformers' cast. A model that keeps
    some modules in fp32 whatever the dtype (`_keep_in_fp32_modules`, which transformers applies while loading,
    not in the skeleton) loads as transformers loads it.
    """
    import torch

    saved = config.get("dtype") or config.get("torch_dtype")
    if dtype == "auto" or saved not in ("float32", "bfloat16", "float16") or getattr(torch, saved) == dtype:
        return dtype
    if getattr(skeleton, "_keep_in_fp32_modules", None) or getattr(skeleton, "_keep_in_fp32_modules_strict", None):
        return dtype
    # Every layer stays in memory: nothing is read as it runs. transformers casts as it loads, with each stored
    # tensor mapped from the file until the load ends: both dtypes at once (1.5x a widened model, 3x a narrowed
    # one, in the bytes it runs in).
    size = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    if size * (1 + getattr(torch, saved).itemsize / dtype.itemsize) <= budget.weights_room(reserve):
        return dtype
    return getattr(torch, saved)


def running_dtypes(skeleton) -> dict:
    """The dtype of each parameter and buffer of `skeleton`, a model built in the dtype it will run in (on the meta
    device, as `from_pretrained` builds it before loading): `dtype` for most, float32 for the buffers a model
    computes in float32 whatever its dtype (RoPE's `inv_freq`). transformers loads each tensor of a checkpoint
    into the dtype its model has for it, so these are the dtypes its own load in that dtype gives."""
    return {name: t.dtype for name, t in (*skeleton.named_parameters(), *skeleton.named_buffers())}


def cast_weights(model, loaded, dtypes: dict) -> None:
    """Cast the weights and buffers `from_pretrained` gave in dtype `loaded` to those `dtypes` (`running_dtypes`)
    gives them: those in memory now, and those on disk (meta tensors) as their layers run. A tensor that is
    float32 by design stays float32 when the model narrows to bf16. `.data` keeps tied weights one tensor.

    The cast is `Tensor.to`, as transformers' own while loading: the same bits, one tensor or the whole model."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.dtype == loaded and dtypes[name] != loaded:
            tensor.data = tensor.data.to(dtypes[name])


def cast_placement(skeleton, loaded, dtype) -> dict:
    """`placement`'s `scale` and `cast_largest` for a model loaded in dtype `loaded` to run in `dtype` (none when
    they are the same): accelerate places it by the sizes it will have once cast, with room for both dtypes
    of the layers in memory until `cast_weights` ends."""
    if loaded == dtype or not hasattr(loaded, "itemsize") or not hasattr(dtype, "itemsize"):
        return {}
    return {"scale": loaded.itemsize / dtype.itemsize, "cast_largest": largest_layer(skeleton)[1]}


def read_layers_whole(model) -> None:
    """Make each block accelerate never splits (`_no_split_modules`, a decoder layer) that stays on disk read
    all its weights when it starts and drop them when it ends.

    accelerate's dispatch (what `from_pretrained` runs) hooks every module of an offloaded layer on its own: a
    module's weights are read when *it* runs. Code that reads a module's weights without calling it then reads
    the meta tensor left in their place, uninitialised memory, and gives wrong numbers without an error: fla's
    fused SwiGLU (`fuse_swiglu=True`, its default) hands `down_proj.weight` to its kernel, HGRN2's
    `rms_norm_linear` `o_proj.weight`. accelerate's answer is `preload_module_classes` (a block read whole at
    its start), which transformers does not pass; this hooks the blocks the same way after loading. The
    budget holds room for one such block already (`check_holds`, accelerate's reserve).
    """
    from accelerate.hooks import AlignDevicesHook, attach_align_device_hook, remove_hook_from_module

    blocks = set(model._no_split_modules or [])
    for name, block in model.named_modules():
        if type(block).__name__ not in blocks:
            continue
        hooks = [m._hf_hook for m in block.modules() if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook)]
        offloaded = [hook for hook in hooks if hook.offload and hook.weights_map is not None]
        if not offloaded or offloaded[0].place_submodules:  # in memory, or read whole already
            continue
        hook = offloaded[0]
        remove_hook_from_module(block, recurse=True)
        attach_align_device_hook(
            block, execution_device=hook.execution_device, offload=True, weights_map=hook.weights_map.dataset,
            module_name=name, skip_keys=hook.skip_keys, preload_module_classes=[type(block).__name__],
            tied_params_map=hook.tied_params_map,
        )


def collect_if_alive(model: weakref.ref) -> None:
    """Free the model `model` refers to, once its holder has dropped it, before the next one loads.

    A model that accelerate dispatched (layers offloaded to disk) is tied into reference cycles by its
    hooks and stays in memory until a garbage collection; a model held whole in memory has none and is
    already gone. So the collection runs only where the model is still alive: in a process that has
    imported transformers it scans millions of objects (~0.2 s here), which a small model's conversion
    paid twice for nothing.
    """
    if model() is not None:
        gc.collect()
