"""gated-attention: gated softmax attention and hybrid Gated DeltaNet models for transformers.

The files at this level:

- `__init__` (this file): the public names, `CLIError`, `GatedAttentionWarning`
  and `register_auto_classes`.
- `compat`: every difference between the supported transformers releases.
- `cli_common`: what every command line shares (the `gated-attention`
  commands, the examples and the benchmarks): `OneLineErrorParser` (argparse,
  with a usage error as one line), `bounded` (an argparse type for a number in
  a range), `memory_size` / `parse_size` / `format_size` (`--max-memory 4GB`),
  `first_line` (an exception as one line) and `sigterm_as_interrupt` (`kill PID`
  unwinds like Ctrl-C). Standard library only, and it imports nothing of ours,
  so every layer may use it.
- `cli`: the `gated-attention` command, built from each part's `register`.
- `__main__`: `python -m gated_attention`, the same command.

The parts, lowest layer first (each imports only its own files and lower
layers; docs/architecture.md has the rule, `tests/test_layout.py` checks it):
`compat` and `cli_common`; `configuration`, `kernels` and `hub`; `files`,
`memory` and `fla_cpu`; `modeling`; then this file; `training`,
`analysis` and `convert`; `recipes`; `cli`. Each part's `__init__` maps its
files.

Importing the package registers its configs and models with AutoConfig,
AutoModel and AutoModelForCausalLM (`register_auto_classes`).

One exception keeps the command line quick: while the `gated-attention`
command starts (the console script, or `python -m gated_attention`), Python
imports this package before the command can say anything, and registering
means importing torch and transformers' modeling stack (seconds). So then
nothing is registered here, and the commands call `register_auto_classes()`
where they read our checkpoints through the Auto classes: `--help` and usage
errors answer at once, and `convert --no-verify` imports no modeling code.

The public names below are imported on first use (module `__getattr__`);
after a normal `import gated_attention` the registration has imported them all.
"""

from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"


class CLIError(Exception):
    """A user-facing error of the `gated-attention` command: printed as one line, exit status 2.

    Defined here, below every sub-package, so that the command modules of
    `convert`, `analysis` and `recipes` can raise it without importing `cli`
    (which imports them to build its parser).
    """


class GatedAttentionWarning(UserWarning):
    """Something the user should know that does not stop the work (e.g. folders a killed run left behind).

    The `gated-attention` command prints each one as one line: `gated-attention COMMAND: warning: ...`.
    """


# public name -> the module that defines it
_EXPORTS = {
    "DEFAULT_GATE_SPEC": ".configuration.gate_spec",
    "normalize_gate_spec": ".configuration.gate_spec",
    "GatedAttentionConfig": ".configuration.gated_attention",
    "GatedAttentionMoeConfig": ".configuration.gated_attention_moe",
    "GatedDeltaNetHybridConfig": ".configuration.gated_deltanet_hybrid",
    "GatedAttentionForCausalLM": ".modeling.gated_attention",
    "GatedAttentionModel": ".modeling.gated_attention",
    "GatedAttentionMoeForCausalLM": ".modeling.gated_attention_moe",
    "GatedAttentionMoeModel": ".modeling.gated_attention_moe",
    "GatedDeltaNetHybridForCausalLM": ".modeling.gated_deltanet_hybrid",
    "GatedDeltaNetHybridModel": ".modeling.gated_deltanet_hybrid",
    "GlobalLoadBalancer": ".modeling.load_balancing",
    "SinkCache": ".modeling.sink_cache",
}

__all__ = sorted(_EXPORTS) + ["CLIError", "GatedAttentionWarning", "register_auto_classes"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def register_auto_classes() -> None:
    """Register our model types (`hub.remote_code.MODEL_TYPES`) with AutoConfig, AutoModel and
    AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .hub.remote_code import MODEL_TYPES

    for model_type, record in MODEL_TYPES.items():
        config, model, causal_lm = map(__getattr__, (record.config_class, record.base_model, record.causal_lm))
        AutoConfig.register(model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)
    # transformers' own models gated by declaration: one config class per source, made as a checkpoint names it
    from .configuration.declared import DECLARED_MODEL_TYPE, GatedDeclaredConfig, on_declared_config_class
    from .modeling.declared import register_declared_models

    AutoConfig.register(DECLARED_MODEL_TYPE, GatedDeclaredConfig, exist_ok=True)
    on_declared_config_class(register_declared_models)
    for name in _EXPORTS:  # the rest of the public names, so that a normal import has them all
        __getattr__(name)


def _starting_cli() -> bool:
    """Is this interpreter starting the `gated-attention` command?

    The console script imports `gated_attention.cli` with sys.argv[0] = its path.
    `python -m gated_attention`: runpy imports this package while it locates
    `gated_attention.__main__`, and until then sys.argv[0] is "-m" (Python's
    documented behaviour). So is it for `python -m mypkg.train` while it imports
    `mypkg`, which may import this package and then expects the registration:
    hence the module name is read from the interpreter's own command line.
    """
    argv = getattr(sys, "argv", None) or [""]
    if os.path.basename(argv[0]) in ("gated-attention", "gated-attention.exe", "gated-attention-script.py"):
        return True
    if argv[0] != "-m":
        return False
    command = list(getattr(sys, "orig_argv", []))[1:]
    for i, arg in enumerate(command):
        if arg.startswith("-m"):  # `-m NAME` or `-mNAME`
            module = arg[2:] or (command[i + 1] if i + 1 < len(command) else "")
            return module == "gated_attention"
    return False


if not _starting_cli():
    register_auto_classes()
