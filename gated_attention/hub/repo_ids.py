"""A model argument names a local folder or a Hugging Face Hub repo id: which one, without the network.

An existing path is a folder. Anything else is a Hub repo id (`org/name` or
`name`) when huggingface_hub's own validator accepts it, optionally followed by
a folder inside the repo, for a repo that holds several models:
`QwQZh/gated_attention/1B_gate_headwise` is the folder `1B_gate_headwise` of the
repo `QwQZh/gated_attention` (the spelling of huggingface_hub's `hf://` paths).
`./run`, `/data/x`, `~/x` and `org//name` never are. `cached_or_downloaded` is
the one policy for fetching such an id: the local cache first, then the Hub
(`convert`'s SRC, `--dataset`); with a folder, only that folder's files are
fetched, and the folder in the snapshot is what it returns. `analyze` asks the
Hub first, on purpose (`analysis/cli.py`).
"""

from __future__ import annotations

from pathlib import Path

from ..cli_common import first_line


def split_subfolder(name: str) -> tuple[str, str | None]:
    """`org/name/sub/dir` -> (`org/name`, `sub/dir`); a name of one or two parts -> (name, None)."""
    parts = name.split("/")
    if len(parts) <= 2:
        return name, None
    return "/".join(parts[:2]), "/".join(parts[2:])


def valid_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, subfolder = split_subfolder(name)
    if subfolder is not None and any(part in ("", ".", "..") for part in subfolder.split("/")):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def missing_folder(name: str) -> bool:
    """True when `name` is no existing path and cannot be a Hub repo id (`./run`, `/data/x`, `~/x`).

    `org/name`, `name` and `org/name/folder` that do not exist locally may be repo ids (the last one a folder
    in one); huggingface_hub's own validator decides.
    """
    return not Path(name).expanduser().exists() and not valid_repo_id(name)


def is_hub_id(name: str) -> bool:
    """True when `name` is no existing path but can be a Hub repo id: the sources `resolve_source` downloads."""
    return not Path(name).expanduser().exists() and valid_repo_id(name)


class HubUnavailable(Exception):
    """A repo neither in huggingface_hub's cache nor to be had from the Hub; the message is the reason, one line."""


# What a model folder holds its weights in: a folder with config.json and none of these is not whole.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack")


def missing_weights(folder: Path) -> str | None:
    """Why a cached model folder is not whole, judged from its own files (None: it looks whole): a weights index
    that names a shard it lacks, or a config.json without any weight file (a download cut short, or one file
    fetched alone)."""
    import json

    for index in sorted(folder.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            continue  # not an index this check can read: loading says what is wrong with it
        lacking = sorted(shard for shard in shards if isinstance(shard, str) and not (folder / shard).is_file())
        if lacking:
            return f"it lacks {lacking[0]}{f' and {len(lacking) - 1} more' if len(lacking) > 1 else ''}, which {index.name} names"
    if (folder / "config.json").is_file() and not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
        return "it holds config.json but no weight file"
    return None


def cached_or_downloaded(
    repo_id: str, *, repo_type: str | None = None, revision: str | None = None, allow_patterns: list[str] | None = None
) -> Path:
    """A Hub repo's snapshot folder (or, for `org/name/folder`, that folder in it): huggingface_hub's cache
    first, without the network, then the Hub.

    So a cached repo works offline. A cached model folder that is not whole (`missing_weights`, or huggingface_hub's
    own record of the repo's files) is completed from the Hub where the network is allowed; with HF_HUB_OFFLINE set
    nothing is downloaded and the cache is taken as it is. Raises `HubUnavailable` ("not in the Hugging Face cache
    (...)", "the Hub could not provide it (...)", "the repo ... has no folder ..."), which the caller puts after
    its own "SRC x: no such folder, and ".
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    repo_id, subfolder = split_subfolder(repo_id)
    if subfolder is not None:  # that model's files only, not the repo's other models
        allow_patterns = [f"{subfolder}/{pattern}" for pattern in allow_patterns or ["*"]]
    offline = constants.HF_HUB_OFFLINE
    try:
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
                                        local_files_only=True)) / (subfolder or "")
        if not folder.is_dir():
            cached = f"its cached snapshot of {repo_id} has no folder {subfolder}"
        elif offline or repo_type is not None or (why := missing_weights(folder)) is None:
            return folder
        else:
            cached = f"its cached {f'folder {subfolder}' if subfolder else 'snapshot'} is not whole ({why})"
    except (LocalEntryNotFoundError, IncompleteSnapshotError, FileNotFoundError, ValueError):
        cached = None
    if offline:
        raise HubUnavailable(f"not in the Hugging Face cache (HF_HUB_OFFLINE is set){f': {cached}' if cached else ''}")
    try:
        snapshot = snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise HubUnavailable(f"{cached + ', and ' if cached else ''}the Hub could not provide it ({first_line(e)})") from None
    folder = Path(snapshot) / (subfolder or "")
    if not folder.is_dir():
        raise HubUnavailable(f"the repo {repo_id} has no folder {subfolder}")
    return folder
