"""A model argument names a local folder or a Hugging Face Hub repo id: which one, without the network."""

from __future__ import annotations

from pathlib import Path


def missing_folder(name: str) -> bool:
    """True when `name` is no existing path and cannot be a Hub repo id (`./run`, `/data/x`, `a/b/c`, `~/x`).

    `org/name` and `name` that do not exist locally may be repo ids; huggingface_hub's own validator decides.
    """
    if Path(name).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False
