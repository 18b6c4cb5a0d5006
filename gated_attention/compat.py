"""Every difference between the transformers releases this package supports (5.17 to 5.25), in one place.

The models are written against the newest API. A difference that shows in the
installed release (a name, a module, a dataclass field) is detected, so that a
release that backports it just works. One that shows only when the code runs
(how `generate()` treats a cache, a bug of some releases) is keyed by the
version, and so is the supported range.

Detected:

- `CACHE_NAME`: the cache argument and output field (model forwards, model
  outputs, the mask builders such as `create_causal_mask`) are `cache` from
  5.24 on, `past_key_values` before. Model code here says `cache`.
- `slice_logits_to_keep`: `transformers.modeling_utils`' from 5.23 on, ours
  before (looked up lazily: see `__getattr__`).
- `get_recurrent_state`: `Cache.get_recurrent_state` of a linear-attention
  layer, from 5.23 on; read off the layer before.
- `EXPERT_PARALLEL_SIZE`, `MOE_EXPERT_PARALLEL_PLAN`: expert parallelism is a
  size of its own (`DistributedConfig(ep_size=...)`, the "ep_dispatch_experts"
  style) after 5.17; in 5.17 `enable_expert_parallel=True` swaps the
  tensor-parallel plan for an expert plan with a router rule ("ep_router").
- `tensor_parallel_api`: `transformers.distributed.tensor_parallel` from 5.25
  on (`transformers.integrations.tensor_parallel` is a shim there), whose layer
  styles' hooks get `config=` (and `mesh_manager=`); 5.17-5.24 call them with
  three arguments. The package's styles pass on whatever keywords they are
  given (`modeling/tensor_parallel.py`).
- transformers' fla-dispatching torch functions (`torch_chunk_gated_delta_rule`,
  ...) are `kernels` function modules in 5.25, which choose the torch path for
  CPU tensors themselves, and plain `functools.wraps` wrappers that call fla
  whatever the device in 5.17-5.24: `analysis/capture.py` unwraps what it finds.

By version:

- `ATTENTION_FREE_CACHED_GENERATE`: before 5.24, `generate()` asks the cache for
  its length, which a cache of linear-attention layers alone cannot tell, so a
  model without attention layers generates only with `use_cache=False` there.
- `EXPERT_GRADIENTS_WRONG_UNDER_FSDP`: 5.20-5.22's expert gradients under FSDP
  with expert parallelism (see the comment there).
- The supported range, `TRANSFORMERS_FLOOR` up to `TRANSFORMERS_CEILING`.

Importing this module checks the installed release first, so a checkpoint's
remote-code copy fails with one line naming the release it needs instead of an
`ImportError` or `TypeError` deep inside a forward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import transformers
from packaging.version import Version

TRANSFORMERS_FLOOR = "5.17"
TRANSFORMERS_CEILING = "5.26"  # exclusive: the newest release tested is 5.25 (pyproject.toml says why)
SUPPORTED_TRANSFORMERS = f"transformers>={TRANSFORMERS_FLOOR},<{TRANSFORMERS_CEILING}"

if not Version(TRANSFORMERS_FLOOR) <= Version(transformers.__version__) < Version(TRANSFORMERS_CEILING):
    raise ImportError(
        f"gated-attention models need {SUPPORTED_TRANSFORMERS}; "
        f"this environment has transformers {transformers.__version__} "
        f'(pip install "{SUPPORTED_TRANSFORMERS}")'
    )

# After the version check, which must fail before anything else can.
import torch  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

ATTENTION_FREE_CACHED_GENERATE = Version(transformers.__version__) >= Version("5.24")
EXPERT_PARALLEL_SIZE = "ep_size" in transformers.DistributedConfig.__dataclass_fields__
# transformers 5.20-5.22 under DistributedConfig(fsdp_size=N, ep_size=N) give the experts wrong gradients (off by
# half the largest on 2 ranks, its own Qwen3-MoE alike); 5.19 refuses the pair itself and 5.23 is exact
# (tests/test_tensor_parallel.py). The package refuses it there rather than train on them.
EXPERT_GRADIENTS_WRONG_UNDER_FSDP = Version("5.20") <= Version(transformers.__version__) < Version("5.23")
# Qwen3-MoE's expert plan in each API (names relative to the base model).
MOE_EXPERT_PARALLEL_PLAN = (
    {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    if EXPERT_PARALLEL_SIZE
    else {
        "layers.*.mlp.gate": "ep_router",
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
)
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def accepts_cache_kwarg(forward):
    """Let a forward written with `cache=` also take the installed release's name for it.

    On releases that say `cache`, `past_key_values=` is deprecated there and
    transformers' own decorator maps it (with its warning). Older releases'
    `generate()` passes `past_key_values=` on every step: that is mapped silently.
    """
    if CACHE_NAME == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)

    return wrapped


def with_cache(output_class, cache: Cache | None, **fields):
    """`output_class(..., cache=cache)` under the installed release's field name."""
    return output_class(**fields, **{CACHE_NAME: cache})


def cache_of(output) -> Cache | None:
    """The cache an output carries, whatever the installed release calls the field."""
    return getattr(output, CACHE_NAME)


def mask_kwargs(cache: Cache | None, **kwargs) -> dict:
    """Keyword arguments for transformers' mask builders (`create_causal_mask`, ...)."""
    return {**kwargs, CACHE_NAME: cache}


def _slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """`[B, T, D]` -> the positions the logits are needed for: the last `logits_to_keep` (0 = all) or given indices."""
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden_states[:, logits_to_keep, :]


def __getattr__(name: str):
    # `slice_logits_to_keep` lives in transformers.modeling_utils (from 5.23), whose import takes seconds:
    # looked up on first use, so that configs (and `convert --no-verify`) import this module without it.
    if name != "slice_logits_to_keep":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # before 5.23
        slice_logits_to_keep = _slice_logits_to_keep
    globals()[name] = slice_logits_to_keep
    return slice_logits_to_keep


@functools.cache
def tensor_parallel_api():
    """transformers' tensor-parallel module: `ALL_PARALLEL_STYLES`, `ColwiseParallel`, `TensorParallelLayer`, ..."""
    try:
        from transformers.distributed import tensor_parallel
    except ImportError:  # before 5.25
        from transformers.integrations import tensor_parallel
    return tensor_parallel


def get_recurrent_state(cache: Cache, layer_idx: int) -> torch.Tensor | None:
    """The linear-attention layer's recurrent state, or None before its first update."""
    if hasattr(cache, "get_recurrent_state"):
        return cache.get_recurrent_state(layer_idx)
    layer = cache.layers[layer_idx]  # before 5.23: the same rule, read off the layer
    return layer.recurrent_states[0] if layer.has_previous_state[0] else None
