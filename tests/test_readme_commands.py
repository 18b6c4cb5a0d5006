"""The README's example commands run as written after the commands before them.

The LoRA line relied on the default `--seq-len 512`, longer than quickstart's model (refused), and the
try-out line did not say it needs the full quickstart's model (`--smoke`'s has 32 positions)."""

from __future__ import annotations

import re
from pathlib import Path

from gated_attention.recipes.settings import SMOKE, Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
TRAINING_SCRIPTS = ("continued_pretraining.py", "lora_finetune.py")


def _commands() -> list[str]:
    """Each command of the README's bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split("#")[0].strip() for line in joined.splitlines() if line.split("#")[0].strip()]
    return commands


def _seq_len(command: str) -> int | None:
    found = re.search(r"--seq-len (\d+)", command)
    return int(found[1]) if found else None


def test_every_training_command_gives_its_seq_len():
    """The default (512) fits no model the README names; a command that relies on it is refused."""
    runs = [c for c in _commands() if any(f"examples/{s}" in c for s in TRAINING_SCRIPTS) and "--model" in c
            and "..." not in c]
    assert len(runs) >= 3, runs
    missing = [c for c in runs if _seq_len(c) is None]
    assert not missing, missing


def test_the_try_out_command_fits_the_model_it_names():
    """It fits the full quickstart's model (max_position_embeddings = its seq_len) and not --smoke's, so the
    README must say which quickstart it follows."""
    try_out = next(c for c in _commands() if "runs/try" in c)
    assert SMOKE["seq_len"] < _seq_len(try_out) <= Settings().seq_len, try_out
    assert "not --smoke" in README and f"`quickstart --smoke`'s has {SMOKE['seq_len']}" in README
