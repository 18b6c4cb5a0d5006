"""The example scripts (`examples/*.py`) imported as modules, so tests call their `main(argv)` in process, and the
tiny checkpoint they train."""

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


def save_tiny_model(folder: Path, max_chars: int, **sizes) -> Path:
    """A tiny random G1-gated model with the embedded tokenizer (trained on `max_chars` of the corpus), saved
    like a converted checkpoint; `sizes` are config fields (hidden_size, num_hidden_layers, ...)."""
    import torch

    import gated_attention
    from gated_attention.training import data

    tokenizer = data.load_tokenizer(300, max_chars=max_chars)
    config = gated_attention.GatedAttentionConfig(vocab_size=len(tokenizer), num_attention_heads=2,
                                                  **{"attn_gate": {"position": "G1"}, **sizes})
    torch.manual_seed(0)
    gated_attention.GatedAttentionForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
