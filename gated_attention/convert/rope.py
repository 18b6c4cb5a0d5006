"""RoPE base change and YaRN context extension, written as transformers' `rope_parameters`.

The numbers are computed by transformers itself (`ROPE_INIT_FUNCTIONS` in
`modeling_rope_utils`, run by the model's rotary embedding); this module only
builds and checks the dict. One trap it closes: for YaRN, transformers fills a
missing `original_max_position_embeddings` with `max_position_embeddings`
without a word, and the correction ramp of YaRN is computed from that length,
so an extended config that forgets it gets the wrong frequencies. Here it is
required, checked against the source, and `max_position_embeddings` becomes
`factor * original_max_position_embeddings`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConversionError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeChange:
    """What `--rope-theta`, `--yarn-factor` and `--original-max-position-embeddings` ask for.

    The options are checked against each other here, when the change is made (the command line makes it
    while parsing, before anything heavy is imported); `apply_rope_change` checks them against SRC.
    """

    rope_theta: float | None = None
    yarn_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_theta is not None and not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConversionError(f"--rope-theta must be a positive number, got {self.rope_theta}")
        if self.original_max_position_embeddings is not None and self.yarn_factor is None:
            raise ConversionError("--original-max-position-embeddings is only used with --yarn-factor")
        if self.yarn_factor is None:
            return
        if self.original_max_position_embeddings is None:
            raise ConversionError(
                "--yarn-factor needs --original-max-position-embeddings (the context length the model was trained "
                "at); transformers would silently use max_position_embeddings, which gives YaRN the wrong ramp"
            )
        if not (self.yarn_factor > 1 and math.isfinite(self.yarn_factor)):
            raise ConversionError(f"--yarn-factor must be a number > 1, got {self.yarn_factor}")
        original = self.original_max_position_embeddings
        if isinstance(original, bool) or not isinstance(original, numbers.Integral) or original <= 0:
            raise ConversionError(f"--original-max-position-embeddings must be a positive integer, got {original}")
        if self.yarn_factor * original != int(self.yarn_factor * original):
            raise ConversionError(
                f"--yarn-factor {self.yarn_factor:g} x --original-max-position-embeddings {original} = "
                f"{self.yarn_factor * original:g} is not a whole number of positions"
            )

    @property
    def empty(self) -> bool:
        return self.rope_theta is None and self.yarn_factor is None and self.original_max_position_embeddings is None

    def check_not_empty(self) -> None:
        if self.empty:
            raise ConversionError(
                "nothing to do: give --rope-theta and/or --yarn-factor with --original-max-position-embeddings"
            )

    def describe(self) -> str:
        parts = []
        if self.rope_theta is not None:
            parts.append(f"RoPE base {self.rope_theta:g}")
        if self.yarn_factor is not None:
            parts.append(f"YaRN factor {self.yarn_factor:g} over {self.original_max_position_embeddings} positions")
        return ", ".join(parts)


def apply_rope_change(
    rope_parameters: dict, max_position_embeddings: int, change: RopeChange
) -> tuple[dict, int]:
    """Return `(rope_parameters, max_position_embeddings)` after `change`.

    `rope_parameters` is the source's standardised dict (transformers 5 form,
    with `rope_type` and `rope_theta`). Raises ConversionError for options that
    are missing, inconsistent, or that have no exact meaning for this source.
    """
    params = dict(rope_parameters or {})
    if change.empty:
        return params, max_position_embeddings
    if any(isinstance(v, dict) for v in params.values()):
        raise ConversionError("SRC has per-layer-type rope_parameters; RoPE options are not supported for it")
    rope_type = params.get("rope_type", "default")
    if change.rope_theta is not None:
        params["rope_theta"] = float(change.rope_theta)
    if change.yarn_factor is None:
        return params, max_position_embeddings

    factor, original = change.yarn_factor, change.original_max_position_embeddings
    source_original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and source_original is not None and source_original != original:
        raise ConversionError(
            f"--original-max-position-embeddings {original} contradicts SRC's YaRN original_max_position_embeddings "
            f"{source_original}"
        )
    if rope_type not in ("default", "yarn"):
        raise ConversionError(
            f"SRC already uses rope_type={rope_type!r}; YaRN on top of it is not defined (supported: 'default', 'yarn')"
        )
    if rope_type == "default" and original > max_position_embeddings:
        raise ConversionError(
            f"--original-max-position-embeddings {original} is larger than SRC's max_position_embeddings "
            f"{max_position_embeddings}; it must be the context length SRC was trained at"
        )
    params = {
        "rope_type": "yarn",
        "rope_theta": params.get("rope_theta", 10000.0),
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        **{k: params[k] for k in ("beta_fast", "beta_slow", "partial_rotary_factor") if k in params},
    }
    return params, int(factor * original)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """`(inv_freq, attention_factor)` exactly as transformers computes them for `config`."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = config.rope_parameters["rope_theta"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config)
