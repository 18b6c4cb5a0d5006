"""Verification: source and result run on one fixed prompt, compared layer by layer, within a memory budget.

Both sides run transformers' SDPA on the CPU in the output dtype, so that a
bit-identical conversion compares equal on any machine. They are loaded one
after the other, each placed by accelerate within the budget
(`memory.budget`): the layers that fit stay in memory, the others are read
from the checkpoint's own safetensors files one module at a time while the
prompt runs. Only the reference's outputs (the hidden state after every layer
and the logits, a few MB) are kept while the result runs, so memory holds one
model's share of the budget at a time, whatever the model's size.

An exact conversion must give the same bits after every layer, not only in the
logits: a difference that rounding happens to hide at the end would still be
found, and the error names the first layer where it appears.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import register_auto_classes
from ..cli_common import format_size
from ..configuration.declared import text_config
from ..memory.budget import (MemoryBudget, MemoryBudgetError, cast_placement, cast_weights, collect_if_alive,
                                 loading_dtype, read_layers_whole, reading_reserve, running_dtypes)
from .sources import ConversionError, SourceCheckpoint

VERIFY_TOKENS = 32

# Both sides of a comparison run transformers' SDPA, so that a bit-identical conversion compares equal on
# any machine, whatever default either side's attention implementation has there.
VERIFY_ATTENTION = "sdpa"

BUDGET_REMEDY = "give a larger --max-memory, free some memory, or pass --no-verify; nothing was written"


def verification_ids(vocab_size: int, max_positions: int) -> torch.Tensor:
    """A fixed prompt `[1, T]`: the same token ids on every machine, no tokenizer needed."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, min(VERIFY_TOKENS, max_positions)), generator=g)


@dataclass
class PromptRun:
    """One model's outputs on the fixed prompt."""

    logits: torch.Tensor  # [1, T, V]
    # [1, T, hidden] each, L + 1 of them: the embeddings, then each layer's output (the last one after the
    # final norm, as transformers returns it)
    hidden_states: tuple[torch.Tensor, ...]
    weight_bytes: int  # the model's weights
    offloaded_bytes: int  # of which accelerate left on disk, read while the prompt ran

    def placement(self) -> str:
        if not self.offloaded_bytes:
            return f"all {format_size(self.weight_bytes)} of weights in memory"
        return f"{format_size(self.offloaded_bytes)} of {format_size(self.weight_bytes)} of weights read from disk as it ran"


@dataclass
class Comparison:
    max_abs_diff: float  # of the logits
    bit_identical: bool  # every hidden state and the logits
    max_abs_logit: float  # the scale the difference is measured against
    first_difference: str | None  # where the two runs first differ ("layer 3's output"); None: nowhere


def check_budget(budget: MemoryBudget, config, dtype: torch.dtype, reserve: int = 0) -> None:
    """Refuse, before anything is written, a budget that cannot hold the largest layer of the model `config`
    describes, in `dtype`, beside `reserve` and what running the prompt adds (`prompt_reserve`)."""
    try:
        budget.check_holds(meta_model(config, dtype), BUDGET_REMEDY, reserve + prompt_reserve(config, dtype))
    except MemoryBudgetError as e:
        raise ConversionError(str(e)) from None


def prompt_reserve(config, dtype: torch.dtype) -> int:
    """What running the fixed prompt adds beside the weights, at most, in bytes: both runs' outputs (the hidden
    state after every layer and the logits; the reference's are kept while the result runs) and one layer's
    working memory (q, k, v, the attention's output and gate, the MLP's three projections and its product, the
    residual and the float32 norms), on `VERIFY_TOKENS` tokens."""
    text = text_config(config)
    # (a field a config names otherwise counts 0: BLT's config has no hidden_size of its own)
    hidden, layers, vocab = (getattr(text, key, None) or 0 for key in ("hidden_size", "num_hidden_layers", "vocab_size"))
    widths = [getattr(text, "intermediate_size", None), getattr(text, "moe_intermediate_size", None)]
    # (a list: one width per layer, as Gemma 3n's; None where a config names it otherwise, as GPT-2's n_inner)
    intermediate = max(max(w) if isinstance(w, (list, tuple)) else w or 0 for w in widths)
    tokens, size = VERIFY_TOKENS, dtype.itemsize
    outputs = 2 * ((layers + 1) * tokens * hidden + tokens * vocab) * size
    working = tokens * (8 * hidden + 4 * intermediate) * max(size, 4)
    return outputs + working


def _saved_dtype(config) -> torch.dtype:
    """The dtype `config` says its checkpoint is in (a torch dtype or its name), float32 when it says none."""
    saved = config.dtype
    return saved if isinstance(saved, torch.dtype) else getattr(torch, str(saved), torch.float32)


def meta_model(config, dtype: torch.dtype):
    """The model `config` describes, in `dtype`, on the meta device: its shapes, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


@torch.no_grad()
def run_prompt(
    folder: Path,
    budget: MemoryBudget,
    *,
    dtype: torch.dtype | None,
    vocab_size: int,
    max_positions: int,
    offload_dir: Path,
    forward_context=contextlib.nullcontext,
    strict: bool = False,
    reserve: int = 0,
    log=print,
    model_class=None,
    attn_implementation: str = VERIFY_ATTENTION,
    **load_kwargs,
) -> PromptRun:
    """Load the checkpoint in `folder` within `budget`, run the fixed prompt, and let the model go.

    `offload_dir` holds the temporary offload folder (on DST's disk, not in a tmpfs); `load_kwargs` go to
    `from_pretrained` (config overrides, `config=`, `key_mapping=`). `strict`: every weight of the model
    must come from the checkpoint and every tensor of the checkpoint must have a place in it. `reserve`: what
    running the prompt adds beside the weights (`prompt_reserve`). `log` says how the budget is split before
    the run's first load (`MemoryBudget.say_split`). `model_class`: the class that loads it (default: the Auto
    class's choice).
    """
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    model_class = model_class or AutoModelForCausalLM
    load_dtype, cast = _loading(folder, budget, dtype, load_kwargs)
    dtypes, reserve = cast.pop("dtypes", None), reserve + cast.pop("reserve", 0)
    budget.say_split(reserve, log)
    with budget.placement(dir=offload_dir, reserve=reserve, **cast) as placement:
        model, info = model_class.from_pretrained(
            folder, dtype=load_dtype or "auto", attn_implementation=attn_implementation, output_loading_info=True,
            **placement, **load_kwargs,
        )  # fmt: skip
        if load_dtype != dtype:
            cast_weights(model, load_dtype, dtypes)
        read_layers_whole(model)
        lost = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
        if strict and lost:  # from_pretrained would only warn, and fill a missing weight with random numbers
            raise ConversionError(f"verification failed: the weights in {folder.name} do not fit its model ({lost[0]})")
        with forward_context():
            out = model.eval()(verification_ids(vocab_size, max_positions), output_hidden_states=True)
        sizes = [(p.numel() * p.element_size(), p.device.type == "meta") for p in model.parameters()]
        alive = weakref.ref(model)
        del model
        collect_if_alive(alive)  # a dispatched model's weights in memory, before the next model loads
    return PromptRun(out.logits, tuple(out.hidden_states), sum(n for n, _ in sizes), sum(n for n, off in sizes if off))


def _loading(folder: Path, budget: MemoryBudget, dtype: torch.dtype | None, load_kwargs: dict) -> tuple:
    """The dtype to load `folder` in to run in `dtype`, and `placement`'s keyword arguments for it, with `dtypes`
    (each tensor's dtype once cast, for `cast_weights`) when the two differ.

    A checkpoint stored in another dtype than `dtype` (`convert --dtype float32` on a bf16 SRC, `--dtype
    bfloat16` on an fp32 one) is loaded in its own where layers stay on disk and cast after
    (`memory.budget.loading_dtype`): transformers' cast while loading would read the whole checkpoint (a
    bf16 0.85B Llama verified in fp32 within 1.5 GB peaked at 2.80 GB, the same model stored in fp32 and
    verified in bf16 4.32 GB). The placement then keeps room for a weight read in its stored dtype beside its
    cast. The cast gives each tensor the dtype transformers' own load in `dtype` gives it, by the same
    `Tensor.to`, so the comparison's bits do not depend on which one runs: a narrowing cast is not exact, but
    it is the same cast of the same weights, and RoPE's float32 `inv_freq` stays float32 in both.
    """
    from transformers import AutoConfig

    from .sources import read_config_dict

    stored = read_config_dict(folder)
    if dtype is None or (stored.get("dtype") or stored.get("torch_dtype")) in (None, str(dtype).removeprefix("torch.")):
        return dtype, {}
    skeleton = meta_model(load_kwargs.get("config") or AutoConfig.from_pretrained(folder), dtype)
    reserve = reading_reserve(skeleton, stored.get("dtype") or stored.get("torch_dtype"))
    load_dtype = loading_dtype(skeleton, stored, dtype, budget, reserve)
    cast = cast_placement(skeleton, load_dtype, dtype)
    return load_dtype, {"reserve": reserve, "dtypes": running_dtypes(skeleton), **cast}


def compare_runs(reference: PromptRun, result: PromptRun) -> Comparison:
    a, b = reference.logits, result.logits
    first = None
    last = len(reference.hidden_states) - 1
    for i, (x, y) in enumerate(zip(reference.hidden_states, result.hidden_states)):
        if not torch.equal(x, y):
            first = "the embeddings" if i == 0 else f"layer {i}'s output" + (" after the final norm" if i == last else "")
            break
    if first is None and not torch.equal(a, b):
        first = "the logits"
    return Comparison((a.float() - b.float()).abs().max().item(), first is None, a.abs().max().item(), first)


def _log_and_check(cmp: Comparison, reference_name: str, exact: bool, log, note: str = "") -> float:
    compared = f"max |logits({reference_name}) - logits(DST)| = {cmp.max_abs_diff:g}"
    if exact:
        same = " (bit-identical after every layer and in the logits)" if cmp.bit_identical else ""
        log(f"verify: {compared}{same}{note}")
        if not cmp.bit_identical:
            raise ConversionError(
                f"verification failed: exact conversion changed the outputs, first in {cmp.first_difference} "
                f"(max abs logits diff {cmp.max_abs_diff:g})"
            )
    else:
        log(f"verify: {compared} (--init bias is near-identity, not exact)")
    return cmp.max_abs_diff


def _announce(budget: MemoryBudget, reference_name: str, log) -> None:
    log(f"verifying within {budget.describe()}: {reference_name}, then the result, each loaded with what does not "
        "fit read from disk, compared after every layer on a fixed prompt")  # fmt: skip


def verify_against_source(
    src_folder: Path, stage: Path, config, dtype, overrides: dict, exact: bool, log, budget: MemoryBudget,
    reference_kwargs: dict | None = None, *, source_class=None, result_class=None,
    attn_implementation: str = VERIFY_ATTENTION, strict: bool = False,
) -> float:
    """SRC and the result on the fixed prompt, compared after every layer. `overrides`: what `from_pretrained`
    changes in SRC's config (a RoPE change: DST's fields, or `config=` a whole config). The classes that load
    each side (default: the Auto class's choice) and the attention both run can be given; `strict`: every
    tensor of the result is a weight of its model and every weight is in the file."""
    # With a RoPE change the reference is SRC's weights run with DST's rotary tables: the change itself moves
    # the logits (that is its point), so only the weights' part can be compared, and the line says so.
    reference_name = "SRC" if not overrides else "SRC run with DST's rope_parameters"
    _announce(budget, reference_name, log)
    text = text_config(config)
    prompt = dict(dtype=dtype, vocab_size=text.vocab_size, offload_dir=stage,
                  max_positions=getattr(text, "max_position_embeddings", None) or VERIFY_TOKENS,
                  reserve=prompt_reserve(config, dtype or _saved_dtype(config)), attn_implementation=attn_implementation)
    # `reference_kwargs`: what makes transformers' class run SRC as its own code does (`Family.reference`); then
    # every one of SRC's tensors must find its place in that class.
    reference = run_prompt(src_folder, budget, **prompt, log=log, strict=bool(reference_kwargs), model_class=source_class,
                           **overrides, **(reference_kwargs or {}))
    log(f"verifying: SRC ran with {reference.placement()}")
    result = run_prompt(stage, budget, log=log, model_class=result_class, strict=strict, **prompt)
    log(f"verifying: DST ran with {result.placement()}")
    # What a reader of "0" would otherwise take for "the RoPE change did nothing":
    note = "; DST's logits differ from SRC's own, as the RoPE change makes them" if overrides else ""
    return _log_and_check(compare_runs(reference, result), reference_name, exact, log, note)


def verify_against_ungated(
    ckpt: SourceCheckpoint, stage: Path, config, key_mapping: dict, dtype, exact: bool, log, budget: MemoryBudget
) -> float:
    """fla's own model runs only with CUDA kernels and flash-attn, so the reference is SRC's weights
    in our hybrid model with the gate off: this checks the gate init and every tensor's place, not
    fla's kernels against ours. SRC is read under our names through `key_mapping` (transformers' renaming
    while loading), so its offloaded layers are still read from its own files."""
    log("verifying: fla models need CUDA and flash-attn to run, so the reference is SRC's weights in "
        "gated_deltanet_hybrid with the gate off")  # fmt: skip
    _announce(budget, "the ungated reference", log)
    ref_config = type(config).from_dict({**config.to_dict(), "attn_gate": None})
    target_dtype = dtype or _saved_dtype(config)
    prompt = dict(vocab_size=config.vocab_size, max_positions=config.max_position_embeddings, offload_dir=stage,
                  reserve=prompt_reserve(config, target_dtype))  # fmt: skip
    reference = run_prompt(ckpt.folder, budget, dtype=target_dtype, config=ref_config, key_mapping=key_mapping,
                           strict=True, log=log, **prompt)  # fmt: skip
    log(f"verifying: the ungated reference ran with {reference.placement()}")
    result = run_prompt(stage, budget, dtype=dtype, log=log, **prompt)
    log(f"verifying: DST ran with {result.placement()}")
    return _log_and_check(compare_runs(reference, result), "ungated", exact, log)
