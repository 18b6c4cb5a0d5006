"""`--push-to-hub REPO_ID [--private]`: a written, verified checkpoint folder uploaded as one commit.

The commands push only once DST is whole on disk and verified, so a push that fails (no network, no token,
a repo the token may not write) leaves DST as it is, and the message says how to retry with the Hub's own
command line. The repo is created when missing (`exist_ok`: an existing repo gets a new commit; `private`
applies only to a repo created here, as in huggingface_hub).
"""

from __future__ import annotations

from pathlib import Path

from ..cli_common import first_line


class PushFailed(Exception):
    """The Hub refused or could not take the upload; the message is one line and names the retry."""


def check_repo_id(repo_id: str) -> str | None:
    """Why `repo_id` cannot name a repo to push to (None when it can), without the network."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return first_line(e)
    return None


def push_problem(args) -> str | None:
    """What is wrong with `--push-to-hub REPO_ID` / `--private` as given (None: nothing), found before anything
    runs: `--private` alone, or a REPO_ID the Hub would refuse."""
    if getattr(args, "private", False) and not getattr(args, "push_to_hub", None):
        return "--private applies to the repo --push-to-hub REPO_ID creates; give --push-to-hub too"
    if getattr(args, "push_to_hub", None) and (problem := check_repo_id(args.push_to_hub)):
        return f"--push-to-hub {args.push_to_hub}: {problem}"
    return None


def push_folder(folder: str | Path, repo_id: str, *, private: bool = False, command: str) -> str:
    """Create `repo_id` if missing and upload `folder` to it in one commit whose message names `command`;
    returns the commit's URL. Raises `PushFailed` (one line) on any failure: the folder is left as it is."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    api = HfApi()
    try:
        repo = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo.repo_id, folder_path=folder, repo_type="model",
                                   commit_message=f"Upload with `{command}`")
    except Exception as e:  # noqa: BLE001 - network, auth, a refused repo: each is the one line below
        raise PushFailed(f"pushing {folder} to the Hub repo {repo_id} failed ({first_line(e)}); {folder} is complete "
                         f"on disk: retry with `hf upload {repo_id} {folder}`") from None
    return getattr(commit, "commit_url", None) or str(commit)
