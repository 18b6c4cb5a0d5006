"""The package's shape: no import circles, imports run downward only, no private names across modules.

The graph is read from the source (`ast`), so every import counts, including
those inside functions (they still make a circle, only a later one) and the
module names the lazy loaders keep as strings (`__init__`'s `_EXPORTS`, the
CLI's command modules). Importing `a.b.c` also runs the `__init__` of `a` and
`a.b`; those implicit edges are left out, as Python's own package semantics.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gated_attention"

# Layers, lowest first. A module imports modules of its own part (its sub-package, or itself at the
# root) or of a lower layer, never of a higher one or of a peer part on the same layer.
LAYERS = [
    {"compat", "cli_common"},  # the floor: transformers' differences, and what every command line shares
    {"configuration", "kernels", "hub"},
    # local files and data (above `hub`: a Hub dataset id), the memory budget, fla's models on a CPU (above the
    # kernels they reuse): below the models, which need none of them
    {"files", "memory", "fla_cpu"},
    {"modeling"},
    {"__init__"},  # the package itself: public names, CLIError and the Auto registration
    {"quantization"},  # compressed-tensors' schemes on a model's linear maps: the analysis measures, `quantize` writes
    {"training", "analysis", "convert"},
    {"recipes"},
    {"cli"},
    {"__main__"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
ROOT_MODULES = {"__init__", "__main__", "cli", "compat", "cli_common"}  # everything else lives in a sub-package


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import of our package in `module`'s source."""
    path, is_package = MODULES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "gated_attention"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module) if node.level else node.module or ""
            if target.split(".")[0] != "gated_attention":
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                found.append((sub, []) if sub in MODULES else (target, [a.name]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.startswith("gated_attention.") and text in MODULES:  # "gated_attention.convert.cli"
                found.append((text, []))
            elif text[:1] == "." and text[1:].replace(".", "").isidentifier():  # ".modeling.base"
                found.append((_resolve(module, is_package, 1, text[1:]), []))
    return [(target, names) for target, names in found if target in MODULES and target != module]


GRAPH = {m: sorted({t for t, _ in _imports(m)}) for m in MODULES}


def _part(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_the_root_keeps_only_the_entry_points():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"modules at the package root besides {sorted(ROOT_MODULES)}: {sorted(root - ROOT_MODULES)}"
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert parts <= set(RANK), f"sub-packages without a layer in this test: {sorted(parts - set(RANK))}"


def test_no_import_circles():
    """Tarjan's strongly connected components: any component of more than one module is a circle."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module):
    upward = [t for t in GRAPH[module]
              if _part(t) != _part(module) and RANK[_part(t)] >= RANK[_part(module)]]
    assert not upward, f"{module} imports {upward}, which are not below its layer ({_part(module)})"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    private = [f"{t}.{n}" for t, names in _imports(module) for n in names
               if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert not private, f"{module} imports private names of other modules: {private}"


def test_the_graph_holds_function_level_and_string_imports():
    """The graph reader finds function-level and string imports (else the tests above could not fail)."""
    assert "gated_attention.recipes.cli" in GRAPH["gated_attention.cli"]  # a string in _COMMAND_MODULES
    assert "gated_attention.modeling.gated_attention" in GRAPH["gated_attention"]  # `_EXPORTS`
    assert "gated_attention.convert.convert" in GRAPH["gated_attention.recipes.quickstart"]  # inside a function
    assert RANK[_part("gated_attention.recipes.quickstart")] > RANK[_part("gated_attention.convert.convert")]


def test_our_model_types_are_listed_once():
    """`hub.remote_code.MODEL_TYPES` is the list; the config classes (their `model_type`), the presets' tables and
    the Auto registration agree with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import gated_attention as ga
    from gated_attention.configuration.presets import PRESETS
    from gated_attention.hub.remote_code import MODEL_TYPES

    assert set(PRESETS) == set(MODEL_TYPES)
    for model_type, record in MODEL_TYPES.items():
        config, causal_lm = getattr(ga, record.config_class), getattr(ga, record.causal_lm)
        assert (config.model_type, config.__module__) == (model_type, record.config_module)
        assert causal_lm.__module__ == getattr(ga, record.base_model).__module__ == record.model_module
        assert type(AutoConfig.for_model(model_type)) is config
        assert AutoModelForCausalLM._model_mapping[config] is causal_lm
