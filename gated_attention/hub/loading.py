"""Loading a checkpoint whose weights must be the ones its config describes.

transformers loads a checkpoint whose `config.json` and weights disagree with a
warning table and carries on: a tensor the config implies but the weights lack
is initialised at random (MISSING), a tensor the config does not know is
dropped (UNEXPECTED). A config that says 3 layers over weights of 2 gives a
model with one random layer; one that says 1 layer over weights of 2 gives a
truncated model. Trained or analysed, neither is the checkpoint. `convert`
refuses such a source by planning every tensor (`convert/plan.py`); the
commands that load a model through transformers (`analyze`, the training
examples) call `from_pretrained_checked`, which asks transformers for its
loading info and refuses in one line instead.
"""

from __future__ import annotations

import logging
import re


class WeightsMismatch(ValueError):
    """Weights that are not the ones the config describes; the message is one line naming the first tensor."""


def _natural(name: str) -> list:
    """Sort key: model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _without_load_report(record: logging.LogRecord) -> bool:
    # The MISSING / UNEXPECTED table: its content is the one line this module raises.
    return record.funcName != "log_state_dict_report"


def from_pretrained_checked(model_class, name_or_path, **kwargs):
    """`model_class.from_pretrained(name_or_path, **kwargs)`, or `WeightsMismatch` when the checkpoint's weights
    lack a tensor its config implies, hold one it does not, or hold one of another shape.

    The message names the first such tensor (in layer order) and how many there are. Tied weights a
    checkpoint leaves out (`lm_head.weight` with `tie_word_embeddings`) are not missing: transformers ties
    them before it reports.
    """
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(_without_load_report)
    try:
        model, info = model_class.from_pretrained(name_or_path, output_loading_info=True,
                                                  ignore_mismatched_sizes=True, **kwargs)
    finally:
        logger.removeFilter(_without_load_report)
    missing = sorted(info["missing_keys"], key=_natural)
    unexpected = sorted(info["unexpected_keys"], key=_natural)
    mismatched = sorted(info["mismatched_keys"], key=lambda m: _natural(m[0]))
    more = lambda keys: f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""  # noqa: E731
    if missing:
        raise WeightsMismatch(f"its weights lack tensor {missing[0]}{more(missing)}, which its config implies: "
                              "config.json and the weights disagree")
    if unexpected:
        raise WeightsMismatch(f"its weights hold tensor {unexpected[0]}{more(unexpected)}, which a "
                              f"{model.config.model_type} model with its config does not have: config.json and the "
                              "weights disagree")
    if mismatched:
        name, saved, expected = mismatched[0]
        raise WeightsMismatch(f"its tensor {name}{more(mismatched)} has shape {list(saved)}, and its config implies "
                              f"{list(expected)}: config.json and the weights disagree")
    return model
