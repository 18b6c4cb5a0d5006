"""What `analyze` and `stream` share before and around a model run: MODEL names, --out, MODEL's whereabouts
and config, and the staged output folder.

- `out_dir`: the argparse type of --out (a path that is no file).
- `check_names`: each MODEL and --tokenizer is an existing path or can be a Hub id.
- `check_out`: --out is no input's folder, not being written by another run, and holds nothing or an
  earlier output of the same command (`files.output_folders`).
- `resolve`: a MODEL or --tokenizer to load. A Hub id is looked up with one request first: huggingface_hub
  retries every file for about a minute when the Hub cannot be reached, so an id that is not cached fails
  at once instead, and a cached one loads from the cache.
- `check_config`: MODEL's config.json, before the model is built.
- `staged_output`: DIR written in a staging folder beside it and renamed into place when whole
  (`files.staging`): a failure or Ctrl-C leaves DIR as it was.

Nothing here imports torch: the checks run before it loads.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from .. import CLIError, GatedAttentionWarning
from ..cli_common import first_line, revision_problem
from ..hub.repo_ids import HubUnavailable, cached_or_downloaded, missing_folder, split_subfolder

HUB_TIMEOUT_S = 10  # the one request that asks the Hub whether MODEL exists


def out_dir(text: str) -> str:
    """The argparse type of --out: a path that does not exist or is a folder."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return text


def check_names(models: Sequence[str], tokenizer: str | None, revision: str | None = None) -> None:
    """Each MODEL and --tokenizer: an existing path, or what can be a Hub id; --revision only for a Hub id."""
    for model in models:
        if not model.strip():  # Path("") is the working folder
            raise CLIError("MODEL is empty: give a model folder, a .gguf file or a Hub repo id")
        if missing_folder(model):
            raise CLIError(f"model folder not found: {model}")
    if tokenizer and missing_folder(tokenizer):
        raise CLIError(f"--tokenizer folder not found: {tokenizer}")
    if problem := revision_problem(list(models), revision):
        raise CLIError(problem)


def check_out(out: str, models: Sequence[str], tokenizer: str | None, *, what: str, ours: Sequence[str],
              inputs: dict[str, Path] | None = None) -> None:
    """--out: not the working folder or above it, not an input's folder (MODEL, --tokenizer, `inputs`), not being
    written by another run, and, if it holds anything, an earlier output of this command (one of `ours`, which
    `what` describes), which the run replaces whole when it is done."""
    from ..files.output_folders import OutputFolderError, check_output_folder, holds_any
    from ..files.staging import refuse_nested, refuse_running

    found = dict(inputs or {})
    for name in models:
        if Path(name).expanduser().exists():
            found["MODEL" if len(models) == 1 else f"MODEL {name}"] = Path(name).expanduser()
    if tokenizer and Path(tokenizer).expanduser().exists():
        found["--tokenizer"] = Path(tokenizer).expanduser()
    try:
        check_output_folder(out, flag="--out", what=what, ours=holds_any(*ours), inputs=found)
        refuse_running(Path(out).expanduser(), "--out")
        refuse_nested(Path(out).expanduser(), "--out")
    except OutputFolderError as e:
        raise CLIError(str(e)) from None


def resolve(name: str, revision: str | None = None) -> str:
    """`name` to load: itself (a path, or a Hub id the Hub answers for), or the folder of its snapshot in the
    Hugging Face cache when the Hub cannot be reached (then nothing asks the Hub); a folder inside a repo
    (`org/name/folder`, which transformers takes no id for) as that folder, and a Hub id at `revision` as
    that revision's snapshot folder, both fetched by `cached_or_downloaded`.

    One request (`model_info`, which huggingface_hub does not retry) tells an id the Hub does not know
    and a Hub that does not answer; a failed download would be retried for every file, for a minute.
    """
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if split_subfolder(name)[1] is not None or revision is not None:
        try:
            return str(cached_or_downloaded(name, revision=revision))
        except HubUnavailable as e:
            raise CLIError(f"cannot load model {name!r}: it is no local folder, and {e}") from None
    if constants.HF_HUB_OFFLINE:
        return name  # offline mode: huggingface_hub reads the cache and never asks the Hub
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
        return name
    except RepositoryNotFoundError as e:
        raise CLIError(f"{name!r} is no local folder and no model on the Hub ({first_line(e)})") from None
    except HfHubHTTPError:
        return name  # the Hub answered (a gated repo, a server error, ...): loading says what it means
    except Exception as e:  # noqa: BLE001 - no answer at all: no network, DNS, proxy, timeout
        unreachable = first_line(e)
    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise CLIError(
            f"cannot load model {name!r}: it is no local folder, not in the Hugging Face cache, and the Hub "
            f"cannot be reached ({unreachable})"
        ) from None


def check_config(name: str, resolved: str) -> None:
    """MODEL's config.json, checked before the model is built: a million layers would allocate for minutes."""
    from ..configuration.validation import ConfigError, check_config_file
    from ..hub.gguf import GGUFError, gguf_file

    try:
        if gguf_file(resolved) is not None:  # its config comes from the file's header (`loading.loaded`)
            return
    except GGUFError as e:
        raise CLIError(f"MODEL {e}") from None
    if Path(resolved).is_dir():  # a local folder or a cached snapshot; a Hub id loads its config when loading
        try:
            check_config_file(resolved, f"MODEL {name} config.json")
        except ConfigError as e:
            raise CLIError(str(e)) from None


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """The staging folder that becomes `out` when the block ends without an error (`files.staging`); an earlier
    output or an empty folder at `out` (as `check_out` let through) is replaced whole."""
    from ..files.output_folders import OutputFolderError
    from ..files.staging import refuse_nested, refuse_running, staged_folder

    try:
        staging = staged_folder(out, out.is_dir(), print, flag="--out", overwrite_flag=None, clear_leftovers=True,
                                warn=lambda message: warnings.warn(message, GatedAttentionWarning))
        with staging as stage:
            refuse_running(out, "--out", own=stage)  # another run that started at the same moment
            refuse_nested(out, "--out", own=stage)
            yield stage
    except OutputFolderError as e:
        raise CLIError(str(e)) from None
