"""A model argument names a local folder or a Hugging Face Hub repo id: which one, without the network.

An existing path is a folder. Anything else is a Hub repo id (`org/name` or
`name`) when huggingface_hub's own validator accepts it; `./run`, `/data/x`,
`a/b/c` and `~/x` never are.
"""

from __future__ import annotations

from pathlib import Path


def _valid_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def missing_folder(name: str) -> bool:
    """True when `name` is no existing path and cannot be a Hub repo id (`./run`, `/data/x`, `a/b/c`, `~/x`).

    `org/name` and `name` that do not exist locally may be repo ids; huggingface_hub's own validator decides.
    """
    return not Path(name).expanduser().exists() and not _valid_repo_id(name)


def is_hub_id(name: str) -> bool:
    """True when `name` is no existing path but can be a Hub repo id: the sources `resolve_source` downloads."""
    return not Path(name).expanduser().exists() and _valid_repo_id(name)

