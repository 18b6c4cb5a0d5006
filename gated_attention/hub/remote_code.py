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


def package_class(obj) -> type:
    """The class of `obj` that this package defines: `type(obj)` itself, or the one it was made from where
    something swapped the class of a built model (FSDP2's `fully_shard`, which transformers 5.19 applies under
    `DistributedConfig(tp_size=N, ep_size=N)`, makes an `FSDP<name>` subclass in torch's own module)."""
    for cls in type(obj).__mro__:
        if cls.__module__ == PACKAGE or cls.__module__.startswith(PACKAGE + "."):
            return cls
    raise ValueError(f"{type(obj).__name__} is not a class of {PACKAGE}")


def auto_map_for(model) -> dict[str, str]:
    """The `auto_map` that points the Auto classes at the flat files."""
    config_cls = type(model.config)
    model_cls = package_class(model)
    model_module = flat_module_name(model_cls.__module__)
    config_ref = f"{flat_module_name(config_cls.__module__)}.{config_cls.__name__}"
    base = package_class(model.base_model) if model.base_model is not model else model_cls
    auto_map = {"AutoConfig": config_ref, "AutoModel": f"{model_module}.{base.__name__}"}
    causal_lm = getattr(importlib.import_module(model_cls.__module__), base.__name__.replace("Model", "ForCausalLM"), None)
    if causal_lm is not None:
        auto_map["AutoModelForCausalLM"] = f"{model_module}.{causal_lm.__name__}"
    return auto_map


# model_type -> (modeling module, base model class, causal-LM class): the classes `import gated_attention` registers
MODEL_CLASSES = {
    "gated_attention": (f"{PACKAGE}.modeling.gated_attention", "GatedAttentionModel", "GatedAttentionForCausalLM"),
    "gated_attention_moe": (f"{PACKAGE}.modeling.gated_attention_moe", "GatedAttentionMoeModel", "GatedAttentionMoeForCausalLM"),
    "gated_deltanet_hybrid": (
        f"{PACKAGE}.modeling.gated_deltanet_hybrid", "GatedDeltaNetHybridModel", "GatedDeltaNetHybridForCausalLM"),
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
    module, base, causal_lm = MODEL_CLASSES[config.model_type]
    files = write_bundle(save_directory, module, type(config).__module__)
    flat = flat_module_name(module)
    config.auto_map = {
        "AutoConfig": f"{flat_module_name(type(config).__module__)}.{type(config).__name__}",
        "AutoModel": f"{flat}.{base}",
        "AutoModelForCausalLM": f"{flat}.{causal_lm}",
    }
    config.architectures = [causal_lm]
    return files


def write_remote_code(save_directory: str | os.PathLike, model) -> list[str]:
    """Write the flat modeling files into `save_directory` and set `model.config.auto_map`.

    Returns the names of the files written.
    """
    files = write_bundle(save_directory, package_class(model).__module__, type(model.config).__module__)
    model.config.auto_map = auto_map_for(model)
    return files
