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

from .repo_ids import is_hub_id, split_subfolder

# A link to the repository's model_cards/, so the templates also ship inside wheels.
TEMPLATE_DIR = Path(__file__).parent / "model_cards"


def render_model_card(template: str, **fields: str) -> str:
    """Fill `model_cards/<template>.md`; raises KeyError naming a missing field."""
    path = TEMPLATE_DIR / f"{template}.md"
    if not path.is_file():
        raise FileNotFoundError(f"model card template {path} not found")
    return Template(path.read_text(encoding="utf-8")).substitute(fields)


def base_model_fields(source: str) -> dict[str, str]:
    """`base_model_yaml` and `base_model_line` for a Hub id or a local folder."""
    if is_hub_id(source):
        repo_id, subfolder = split_subfolder(source)  # the Hub's base_model names a repo; its folder goes in the link
        link = f"https://huggingface.co/{repo_id}" + (f"/tree/main/{subfolder}" if subfolder else "")
        return {"base_model_yaml": f"base_model: {repo_id}\n", "base_model_line": f"[{source}]({link})"}
    return {"base_model_yaml": "", "base_model_line": f"A local checkpoint, `{Path(source).name}`."}


def options_rows(options: dict[str, object]) -> str:
    return "\n".join(f"| `{key}` | `{value}` |" for key, value in options.items())


def write_model_card(folder: str | Path, template: str, **fields: str) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(render_model_card(template, **fields), encoding="utf-8")
    return path
