"""Which linear maps each arm of the measurement rounds, and the ignore list that keeps a model's gates.

Every `nn.Linear` is rounded but the output embedding (`lm_head`); embeddings are no linear maps and stay.
A gate is what `modeling.gate_sites` finds: our `attn_gate`'s linear maps, the output-gate projections
transformers ships, or, where the gate is rows of a fused `q_proj` (Qwen3.5, Qwen3-Next), that whole `q_proj`,
since a quantizer rounds that tensor whole. Learned sinks and input-independent gates hold no linear map.

The arms:
- `all`: every linear map;
- `gates_kept`: all but the gates (what `quantize --gates keep` writes: a fused `q_proj` kept whole);
- `gates_only`: the gates alone;
- where a gate is fused: `gate_rows_only` and `query_rows_only`, the fused projections' gate rows or their
  other rows alone, which no stored format can do but which tells which half the error comes from.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..modeling.gate_sites import OUTPUT_GATES, gate_sites

ARMS = ("all", "gates_kept", "gates_only")
FUSED_ARMS = ("gate_rows_only", "query_rows_only")

# The ignore list that keeps every gate module the package writes or reads out of a quantizer's recipe, in the
# three forms the quantizers take: llm-compressor's and compressed-tensors' `ignore` ("re:" + a Python regex of the
# module path), Model-Optimizer's `quant_cfg` keys (fnmatch wildcards of the path) and GPTQModel's
# `dynamic` keys ("-:" + a regex, to skip). Ours is `attn_gate` (its `proj`, or low-rank `down`/`up`); transformers'
# own output gates are the projections of `OUTPUT_GATES`; a gate fused into `q_proj` is kept by keeping that
# `q_proj` (`fused_ignore`), which holds the query too, so it is written only for models that fuse it.
GATE_PATTERNS = (r".*\.attn_gate(\..*)?$",
                 *sorted({rf".*\.self_attn\.{re.escape(name)}$" for names, _ in OUTPUT_GATES.values()
                          for name in ((names,) if isinstance(names, str) else names)}))
FUSED_PATTERN = r".*\.self_attn\.q_proj$"


def ignore_lists(fused: bool = False) -> dict[str, list[str]]:
    """The gate ignore list per quantizer: `llm-compressor` (also compressed-tensors), `modelopt`, `gptqmodel`."""
    patterns = [*GATE_PATTERNS, *([FUSED_PATTERN] if fused else [])]
    return {
        "llm-compressor": ["lm_head", *(f"re:{p}" for p in patterns)],
        "modelopt": ["*lm_head*", *(_wildcard(p) for p in patterns)],
        "gptqmodel": [f"-:{p}" for p in patterns],
    }


def ignore_lists_markdown(fused: bool = False) -> str:
    """The model card's section on keeping the gates out of another quantizer: one line per tool."""
    lists = ignore_lists(fused)
    what = "every gate module" + ("; a gate fused into `q_proj` is kept by keeping that `q_proj`" if fused else "")
    return ("To quantize this checkpoint and keep its gates in full precision, give the quantizer this list of what "
            f"to skip ({what}):\n\n" + "\n".join(f"- {tool}: `{value}`" for tool, value in lists.items()))


def _wildcard(pattern: str) -> str:
    """A path regex of `GATE_PATTERNS` as Model-Optimizer's fnmatch key."""
    text = pattern.removesuffix("$").replace(r"(\..*)?", "*").replace(".*", "*").replace(r"\.", ".")
    return text.replace("\\", "")


def linear_paths(model: nn.Module) -> dict[str, nn.Linear]:
    """Every linear map the schemes round: all of `model`'s `nn.Linear`s but its output embedding, by path."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def gate_rows(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each linear map that holds a gate, by path -> the mask of its gate rows (None: all of its rows)."""
    paths = {id(m): path for path, m in model.named_modules()}
    found = {}
    for site in gate_sites(model).values():
        for linear, rows in site.linears():
            found[paths[id(linear)]] = rows
    return found


def arms(model: nn.Module) -> dict[str, dict[str, torch.Tensor | None]]:
    """Arm name -> {path: rows} of the linear maps it rounds (rows: None for all, or the mask of those that round).
    A model without a gate of linear maps has the arm `all` alone."""
    linears = linear_paths(model)
    gates = {path: rows for path, rows in gate_rows(model).items() if path in linears}
    out = {"all": dict.fromkeys(linears)}
    if not gates:
        return out
    out["gates_kept"] = {path: None for path in linears if path not in gates}
    out["gates_only"] = dict.fromkeys(gates)
    fused = {path: rows for path, rows in gates.items() if rows is not None}
    if fused:
        out["gate_rows_only"] = dict(fused)
        out["query_rows_only"] = {path: ~rows for path, rows in fused.items()}
    return out
