"""Model cards for converted checkpoints, rendered from the templates in `model_cards/`.

The package reaches them through the link `hub/model_cards`, which wheels
resolve into real files.

Templates are Markdown with `$name` placeholders (`string.Template`); every
placeholder must be given, so a renamed field fails loudly instead of leaving
`$name` in a published card.
"""

from __future__ import annotations

from pathlib import Path
from string import Template

from .provenance import Provenance, cached_folder, read_provenance, record_commit

# A link to the repository's model_cards/, so the templates also ship inside wheels.
TEMPLATE_DIR = Path(__file__).parent / "model_cards"

# "How to load" pins a commit: transformers' custom-models guide asks for one wherever remote code is trusted.
PIN_REVISION = ("Replace `COMMIT` with a commit hash of this repo (its \"Files and versions\" tab lists them): with "
                "`trust_remote_code=True` transformers runs the modeling code it downloads, and a pinned commit keeps "
                "that code, and the weights, the ones you checked, where a branch can change under you.")


def render_model_card(template: str, *, source: Provenance, relation: str, tags: list[str], **fields: str) -> str:
    """Fill `model_cards/<template>.md`; raises KeyError naming a missing field.

    The YAML block is huggingface_hub's `ModelCardData` of `source` (`base_model`, `base_model_relation`,
    `license`) with `tags`; the text gets `base_model_line` and `license_line` from it too.
    """
    path = TEMPLATE_DIR / f"{template}.md"
    if not path.is_file():
        raise FileNotFoundError(f"model card template {path} not found")
    data = source.card_data(relation, library_name="transformers", pipeline_tag="text-generation", tags=tags)
    return Template(path.read_text(encoding="utf-8")).substitute(
        card_yaml=data.to_yaml(), base_model_line=source.base_model_line(), license_line=source.license_line(),
        pin_revision=PIN_REVISION, **fields)


def options_rows(options: dict[str, object]) -> str:
    return "\n".join(f"| `{key}` | `{value}` |" for key, value in options.items())


def write_model_card(folder: str | Path, template: str, *, source: Provenance, relation: str, tags: list[str],
                     **fields: str) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_model_card(template, source=source, relation=relation, tags=tags, **fields), encoding="utf-8")
    return path


def write_training_card(folder: str | Path, model: str, *, relation: str, title: str, summary: str,
                        options: dict[str, object], command: str, version: str) -> Path:
    """The card of a training run's saved model (`model_cards/trained_model.md`), its base `model` (`--model`,
    a folder or a Hub id read from the cache) as the source; the base's commit goes into config.json too."""
    source = read_provenance(model, cached_folder(model))
    record_commit(folder, source.commit)
    return write_model_card(folder, "trained_model", source=source, relation=relation, tags=["gated-attention"],
                            title=title, summary=summary, options_rows=options_rows(options), command=command,
                            version=version)
