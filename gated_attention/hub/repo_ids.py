"""A model argument names a local folder or a Hugging Face Hub repo id: which one, without the network.

An existing path is a folder. Anything else is a Hub repo id (`org/name` or
`name`) when huggingface_hub's own validator accepts it; `./run`, `/data/x`,
`a/b/c` and `~/x` never are. `cached_or_downloaded` is the one policy for
fetching such an id: the local cache first, then the Hub (`convert`'s SRC,
`--dataset`). `analyze` asks the Hub first, on purpose (`analysis/cli.py`).
"""

from __future__ import annotations

from pathlib import Path

from ..command_line import first_line


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


class HubUnavailable(Exception):
    """A repo neither in huggingface_hub's cache nor to be had from the Hub; the message is the reason, one line."""


def cached_or_downloaded(
    repo_id: str, *, repo_type: str | None = None, revision: str | None = None, allow_patterns: list[str] | None = None
) -> Path:
    """A Hub repo's snapshot folder: huggingface_hub's cache first, without the network, then the Hub.

    So a cached repo works offline. With HF_HUB_OFFLINE set nothing is downloaded. Raises `HubUnavailable`
    ("not in the Hugging Face cache (...)", "the Hub could not provide it (...)"), which the caller puts
    after its own "SRC x: no such folder, and ".
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, IncompleteSnapshotError, FileNotFoundError, ValueError):
        pass
    if constants.HF_HUB_OFFLINE:
        raise HubUnavailable("not in the Hugging Face cache (HF_HUB_OFFLINE is set)")
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise HubUnavailable(f"the Hub could not provide it ({first_line(e)})") from None
