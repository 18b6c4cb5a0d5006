"""Write a checkpoint's remote-code bundle: flat copies of the modeling files.

transformers loads remote code from one flat folder and follows only sibling
imports of the form `from .x import y` (see `transformers.dynamic_module_utils`).
Our sources live in sub-packages, so each module `gated_attention.<sub>.<name>`
is copied as `<sub>_<name>.py` with its relative imports rewritten to the flat
names, starting from the model's and the config's modules and following their
relative imports. Optional packages (triton, fla) must be imported inside
`try:` blocks in those sources: transformers ignores imports there when it
checks what a remote module needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "gated_attention"
_RELATIVE_IMPORT = re.compile(r"^(\s*)from\s+(\.+)([\w.]*)\s+import\b", flags=re.MULTILINE)


def flat_module_name(module: str) -> str:
    """`gated_attention.modeling.attention` -> `modeling_attention`."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        raise ValueError(f"{module} is not a module of {PACKAGE}")
    return "_".join(parts[1:])


def _resolve(module: str, dots: str, rest: str) -> str:
    package = module.split(".")[: -len(dots)]  # one dot = the module's own package
    if not package:
        raise ValueError(f"relative import {dots}{rest} in {module} leaves the package")
    if not rest:
        raise ValueError(f"{module}: `from {dots} import x` cannot be flattened; import from a module instead")
    return ".".join([*package, rest])


def flatten_source(module: str) -> tuple[str, list[str]]:
    """Return the flattened source of `module` and the package modules it imports."""
    # Read from the file, not imported: writing a bundle must not import transformers' modeling stack.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{module} has no Python source file to copy")
    source = Path(spec.origin).read_text(encoding="utf-8")
    needed: list[str] = []

    def rewrite(match: re.Match) -> str:
        target = _resolve(module, match.group(2), match.group(3))
        needed.append(target)
        return f"{match.group(1)}from .{flat_module_name(target)} import"

    return _RELATIVE_IMPORT.sub(rewrite, source), needed


def bundle_sources(*modules: str) -> dict[str, str]:
    """Flat file name -> source, for `modules` and everything they import relatively."""
    files: dict[str, str] = {}
    todo = list(modules)
    while todo:
        module = todo.pop()
        name = flat_module_name(module) + ".py"
        if name in files:
            continue
        files[name], needed = flatten_source(module)
        todo.extend(needed)
    return files


def auto_map(config_module: str, config_class: str, model_module: str, **classes: str) -> dict[str, str]:
    """The `auto_map` that points the Auto classes at the flat files: the config class, then each Auto class
    (`AutoModel=...`) as a class of `model_module`."""
    flat = flat_module_name(model_module)
    return {"AutoConfig": f"{flat_module_name(config_module)}.{config_class}",
            **{auto: f"{flat}.{name}" for auto, name in classes.items()}}


@dataclass(frozen=True)
class ModelType:
    """One of this package's model types: its classes, as module paths and names (reading them imports nothing)."""

    config_module: str
    config_class: str
    model_module: str
    base_model: str
    causal_lm: str

    def auto_map(self) -> dict[str, str]:
        return auto_map(self.config_module, self.config_class, self.model_module, AutoModel=self.base_model,
                        AutoModelForCausalLM=self.causal_lm)


def _model_type(name: str, config_class: str, model_prefix: str) -> ModelType:
    return ModelType(f"{PACKAGE}.configuration.{name}", config_class, f"{PACKAGE}.modeling.{name}",
                     f"{model_prefix}Model", f"{model_prefix}ForCausalLM")


# config.json's model_type -> its classes: the one list of this package's own model types. `import
# gated_attention` registers these with the Auto classes, `convert` reads a SRC of one of them as already gated,
# and a checkpoint's `auto_map` names them. (Each config class also says its `model_type`, as transformers has it,
# and `configuration.presets` files its shapes under it; `configuration` may not import `hub`, and the presets
# are bundled into every checkpoint, so tests/test_layout.py checks that they agree with this list instead.)
MODEL_TYPES = {
    "gated_attention": _model_type("gated_attention", "GatedAttentionConfig", "GatedAttention"),
    "gated_attention_moe": _model_type("gated_attention_moe", "GatedAttentionMoeConfig", "GatedAttentionMoe"),
    "gated_deltanet_hybrid": _model_type("gated_deltanet_hybrid", "GatedDeltaNetHybridConfig", "GatedDeltaNetHybrid"),
}


def write_bundle(save_directory: str | os.PathLike, *modules: str) -> list[str]:
    """Write the flat copies of `modules` and of everything they import relatively into `save_directory`;
    returns the names of the files written."""
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    files = bundle_sources(*modules)
    for name, source in sorted(files.items()):
        (folder / name).write_text(source, encoding="utf-8")
    return sorted(files)


def write_remote_code_for_config(save_directory: str | os.PathLike, config) -> list[str]:
    """`write_remote_code` for the causal LM of one of our configs, without building (or importing) the model.

    Sets `config.auto_map` and `config.architectures`; returns the names of the files written.
    """
    model_type = MODEL_TYPES[config.model_type]
    files = write_bundle(save_directory, model_type.model_module, model_type.config_module)
    config.auto_map = model_type.auto_map()
    config.architectures = [model_type.causal_lm]
    return files


def write_remote_code(save_directory: str | os.PathLike, model) -> list[str]:
    """Write the flat modeling files into `save_directory` and set `model.config.auto_map` (`save_pretrained` then
    names the model's own class in `architectures`).

    Returns the names of the files written.
    """
    return write_remote_code_for_config(save_directory, model.config)
