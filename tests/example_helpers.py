"""The example scripts (`examples/*.py`) imported as modules, so tests call their `main(argv)` in process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def import_example(name: str) -> ModuleType:
    """`examples/<name>.py` as a fresh module (the examples import each other's helpers from their folder)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))
