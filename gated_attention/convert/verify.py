"""Verification: source and result run on one fixed prompt, their logits compared.

Both sides run transformers' SDPA on the CPU in the output dtype, so that a
bit-identical conversion compares equal on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import register_auto_classes
from .sources import ConversionError, SourceCheckpoint

VERIFY_TOKENS = 32


def verification_ids(vocab_size: int, max_positions: int) -> torch.Tensor:
    """A fixed prompt `[1, T]`: the same token ids on every machine, no tokenizer needed."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, min(VERIFY_TOKENS, max_positions)), generator=g)


@dataclass
class LogitsComparison:
    max_abs_diff: float
    bit_identical: bool
    max_abs_logit: float  # the scale the difference is measured against


@torch.no_grad()
def compare_logits(reference, result, vocab_size: int, max_positions: int) -> LogitsComparison:
    """Compare two models' logits on the fixed prompt."""
    ids = verification_ids(vocab_size, max_positions)
    a = reference.eval()(ids).logits
    b = result.eval()(ids).logits
    return LogitsComparison((a.float() - b.float()).abs().max().item(), torch.equal(a, b), a.abs().max().item())


# Both sides of a comparison run transformers' SDPA, so that a bit-identical conversion compares equal on
# any machine, whatever default either side's attention implementation has there.
VERIFY_ATTENTION = "sdpa"


def load_for_verify(folder: Path, dtype: torch.dtype | None, **config_overrides):
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype or "auto", attn_implementation=VERIFY_ATTENTION, **config_overrides
    )


def verify_against_source(src_folder: Path, stage: Path, config, dtype, overrides: dict, exact: bool, log) -> float:
    # With a RoPE change the reference is SRC's weights run with DST's rotary tables: the change itself moves
    # the logits (that is its point), so only the weights' part can be compared, and the line says so.
    reference_name = "SRC" if not overrides else "SRC run with DST's rope_parameters"
    log(f"verifying: loading {reference_name} and the result, comparing logits on a fixed prompt")
    reference = load_for_verify(src_folder, dtype, **overrides)
    result = load_for_verify(stage, dtype)
    cmp = compare_logits(reference, result, config.vocab_size, config.max_position_embeddings)
    diff, equal = cmp.max_abs_diff, cmp.bit_identical
    del reference, result
    compared = f"max |logits({reference_name}) - logits(DST)| = {diff:g}"
    if exact:
        note = " (bit-identical)" if equal else ""
        if overrides:  # what a reader of "0" would otherwise take for "the RoPE change did nothing"
            note += "; DST's logits differ from SRC's own, as the RoPE change makes them"
        log(f"verify: {compared}{note}")
        if not equal:
            raise ConversionError(f"verification failed: exact conversion changed the logits (max abs diff {diff:g})")
    else:
        log(f"verify: {compared} (--init bias is near-identity, not exact)")
    return diff


def verify_against_ungated(ckpt: SourceCheckpoint, stage: Path, config, rename, dtype, exact: bool, log) -> float:
    """fla's own model runs only with CUDA kernels and flash-attn, so the reference is SRC's weights
    in our hybrid model with the gate off: this checks the gate init and every tensor's place, not
    fla's kernels against ours."""
    log("verifying: fla models need CUDA and flash-attn to run, so the reference is SRC's weights in "
        "gated_deltanet_hybrid with the gate off")
    ref_config = type(config).from_dict({**config.to_dict(), "attn_gate": None})
    # Built in the target dtype (not cast afterwards: .to() would also round RoPE's fp32 inv_freq buffer).
    target_dtype = dtype or getattr(torch, str(config.dtype))
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    reference = AutoModelForCausalLM.from_config(ref_config, dtype=target_dtype, attn_implementation=VERIFY_ATTENTION)
    state = {rename(name): ckpt.read(name) for name in ckpt.tensors if not (config.tie_word_embeddings and name == "lm_head.weight")}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"verification failed: SRC's weights do not fit the ungated model ({(missing + unexpected)[0]})")
    reference.tie_weights()
    result = load_for_verify(stage, dtype)
    cmp = compare_logits(reference, result, config.vocab_size, config.max_position_embeddings)
    del reference, result, state
    if exact:
        log(f"verify: max |logits(ungated) - logits(DST)| = {cmp.max_abs_diff:g}" + (" (bit-identical)" if cmp.bit_identical else ""))
        if not cmp.bit_identical:
            raise ConversionError(f"verification failed: exact conversion changed the logits (max abs diff {cmp.max_abs_diff:g})")
    else:
        log(f"verify: max |logits(ungated) - logits(DST)| = {cmp.max_abs_diff:g} (--init bias is near-identity, not exact)")
    return cmp.max_abs_diff
