"""Where a checkpoint came from, as the Hub's model tree reads it: the source's repo id, its commit, its license.

A command that writes a checkpoint (`convert`, `extend`, `export`, `quantize`, the training examples) reads
its source's provenance once, from what is on disk (no network):

- `base_model`: a Hub id's repo; a local folder's, where it sits in huggingface_hub's cache
  (`models--org--name/snapshots/COMMIT`), else what its own card names as its `base_model` (a folder this
  package wrote from a Hub model names that model), else none. A config's `_name_or_path` is not read: it
  is as often a local path that merely looks like `org/name`.
- `commit`: the snapshot folder the files were read from is named by its commit, so a cached or downloaded
  Hub source, and a local folder inside the cache, have one; any other local folder has none.
- `license`: from the source's card (`README.md` of the folder, or of the cached repo's root for a folder in
  a repo of several models), or its config's `license`; none found is written as none found, never guessed.

The card writers turn it into YAML through huggingface_hub's `ModelCardData` (`card_yaml`) and into sentences.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .repo_ids import is_hub_id, split_subfolder, valid_repo_id

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CACHE_REPO = re.compile(r"^models--(.+)$")

# The relations of the Hub's model tree ("Specifying a base model"); docs/models.md says which command writes which.
RELATIONS = ("adapter", "merge", "quantized", "finetune")


@dataclass(frozen=True)
class Provenance:
    """What a written checkpoint says about its source."""

    name: str  # SRC as the user gave it
    base_model: str | None = None  # a Hub repo id
    subfolder: str | None = None  # the model's folder in that repo, for a repo of several models
    commit: str | None = None  # the snapshot's commit hash
    license: str | None = None  # the Hub's license identifier ("apache-2.0", "other", ...)
    license_name: str | None = None  # with license "other"
    license_link: str | None = None

    def card_data(self, relation: str, **fields):
        """huggingface_hub's `ModelCardData` of a checkpoint made from this source by `relation`, plus `fields`
        (library_name, tags, ...). The relation is written also where no base model is known: it says what
        the checkpoint is, and a `base_model` added by hand then places it."""
        from huggingface_hub import ModelCardData

        if relation not in RELATIONS:
            raise ValueError(f"base_model_relation {relation!r} is none of the Hub's: {', '.join(RELATIONS)}")
        extra = {"base_model_relation": relation}
        if self.base_model:
            extra["base_model"] = self.base_model
        if self.license:
            extra["license"] = self.license
        if self.license_name:
            extra["license_name"] = self.license_name
        if self.license_link:
            extra["license_link"] = self.license_link
        return ModelCardData(**fields, **extra)

    def base_model_line(self) -> str:
        """The card's "Base model" paragraph: the repo (a link at the commit read) or what is known of a local one."""
        if not self.base_model:
            where = f"A local checkpoint, `{Path(self.name).name}`"
            if self.commit:
                return f"{where}, at commit `{self.commit}`; it names no Hub repo it came from."
            return f"{where}; it names no Hub repo it came from, and no commit is known."
        ref = self.commit or "main"
        link = f"https://huggingface.co/{self.base_model}/tree/{ref}" + (f"/{self.subfolder}" if self.subfolder else "")
        shown = self.base_model + (f"/{self.subfolder}" if self.subfolder else "")
        at = f", commit `{self.commit}`" if self.commit else ", commit not known (not read from a Hub snapshot)"
        local = "" if is_hub_id(self.name) else f" (read from the local folder `{Path(self.name).name}`)"
        return f"[{shown}]({link}){at}{local}."

    def license_line(self) -> str:
        if self.license is None:
            return ("No license was found in the source's card or config; none is claimed here. Check the base "
                    "model's own terms before using or sharing this checkpoint.")
        named = f" ({self.license_name})" if self.license_name else ""
        link = f", {self.license_link}" if self.license_link else ""
        return f"`{self.license}`{named}{link}: the source's license, read from its card or config."


def snapshot_of(folder: Path) -> tuple[str | None, str | None, Path | None]:
    """(repo id, commit, snapshot root) when `folder` lies in huggingface_hub's cache
    (`.../models--org--name/snapshots/COMMIT[/sub]`), else (None, None, None)."""
    folder = folder.resolve()
    for snapshot in (folder, *folder.parents):
        if snapshot.parent.name == "snapshots" and _COMMIT.match(snapshot.name):
            found = _CACHE_REPO.match(snapshot.parent.parent.name)
            if found:
                return found[1].replace("--", "/"), snapshot.name, snapshot
    return None, None, None


def _card_metadata(path: Path) -> dict:
    """The YAML block of a model card, {} when there is none or it does not parse."""
    if not path.is_file():
        return {}
    from huggingface_hub import ModelCard

    try:
        return ModelCard(path.read_text(encoding="utf-8"), ignore_metadata_errors=True).data.to_dict()
    except Exception:  # noqa: BLE001 - a card that does not parse names nothing, which the card then says
        return {}


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _first_repo_id(value) -> str | None:
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, str) and valid_repo_id(value) and not Path(value).is_absolute() else None


def cached_folder(name: str, revision: str | None = None) -> Path | None:
    """Where `name` lies on disk: a local path as it is; a Hub id (or a folder in one) as its folder in the
    cached snapshot of `revision` (transformers' `from_pretrained` puts it there), or None if not cached."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not is_hub_id(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    repo_id, subfolder = split_subfolder(name)
    found = try_to_load_from_cache(repo_id, f"{subfolder}/config.json" if subfolder else "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def read_provenance(src: str, folder: str | Path | None) -> Provenance:
    """The provenance of SRC `src`, read from `folder`, what SRC resolved to (for a GGUF file, the folder it
    was dequantized into: its snapshot, if any, is the file's own)."""
    src = str(src)
    folder = Path(folder).resolve() if folder is not None else None
    base_model = commit = root = None
    for candidate in (folder, Path(src).expanduser()):
        if candidate is not None and candidate.exists():
            base_model, commit, root = snapshot_of(candidate)
            if root is not None:
                break
    subfolder = None
    if root is not None and folder is not None and folder != root and folder.is_relative_to(root):
        subfolder = folder.relative_to(root).as_posix()
    if is_hub_id(src):
        base_model, subfolder = split_subfolder(src)
    card = {}
    for where in (folder, root):  # the model's own card, then its repo's (a folder in a repo of several models)
        if where is not None and not card:
            card = _card_metadata(where / "README.md")
    config = _config(folder) if folder is not None else {}
    if base_model is None:
        base_model = _first_repo_id(card.get("base_model"))
    license = card.get("license") or config.get("license")
    if isinstance(license, list):
        license = license[0] if license else None
    if not isinstance(license, str):
        license = None
    other = license == "other"
    return Provenance(src, base_model, subfolder, commit, license, card.get("license_name") if other else None,
                      card.get("license_link") if other else None)


# Written into config.json beside `source_model_type` (a declared model's) by every command that writes a
# checkpoint: the commit of the snapshot the command read, or null where it read none (a local folder).
SOURCE_COMMIT = "source_commit"


def record_commit(folder: str | Path, commit: str | None) -> None:
    """Set `source_commit` in `folder`/config.json, as transformers writes the file (sorted, indent 2).

    Always set, null included: a key copied from the source's own config would name the source's source.
    """
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config[SOURCE_COMMIT] = commit
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
