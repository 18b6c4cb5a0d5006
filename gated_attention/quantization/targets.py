"""Which linear maps each arm of the measurement rounds, and the ignore list that keeps a model's gates.

Every `nn.Linear` is rounded but the output embedding (`lm_head`); embeddings are no linear maps and stay.
A gate is what `modeling.gate_sites` finds: our `attn_gate`'s linear maps, the output-gate projections
transformers ships, or, where the gate is rows of a fused `q_proj` (Qwen3.5, Qwen3-Next), that whole `q_proj`,
since a quantizer rounds that tensor whole. Learned sinks and input-independent gates hold no linear map.

The arms:
- `all`: every linear map;
- `gates_kept`: all but the gates (what `quantize --gates keep` writes: a fused `q_proj` kept whole, with the
  `k_proj` and `v_proj` an engine fuses it with);
- `gates_only`: the gates alone;
- where a gate is fused: `gate_rows_only` and `query_rows_only`, the fused projections' gate rows or their
  other rows alone, which no stored format can do but which tells which half the error comes from.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..modeling.gate_sites import OUTPUT_GATES, gate_sites
from .ignore import FUSED_GATE, OWN_GATE
from .ignore import ignore_lists as quantizer_ignore_lists

ARMS = ("all", "gates_kept", "gates_only")
# Sibling projections that engines load as one matrix (vLLM's qkv_proj and gate_up_proj, DeepSeek's fused latent
# projection): they take one NVFP4 global scale (`rounding`), and vLLM refuses a checkpoint that keeps some of them
# in full precision and rounds the others, so a gate fused into `q_proj` is kept with its `k_proj` and `v_proj`.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))
FUSED_ARMS = ("gate_rows_only", "query_rows_only")

# Every gate module the package writes or reads, as path regexes (`ignore`): ours, and the projections of
# transformers' own output gates (`OUTPUT_GATES`).
GATE_PATTERNS = (OWN_GATE,
                 *sorted({rf".*\.self_attn\.{re.escape(name)}$" for names, _ in OUTPUT_GATES.values()
                          for name in ((names,) if isinstance(names, str) else names)}))


def gate_patterns(fused: bool = False) -> list[str]:
    """`GATE_PATTERNS`, and with `fused` the `q_proj` a gate is fused into."""
    return [*GATE_PATTERNS, *([FUSED_GATE] if fused else [])]


def ignore_lists(fused: bool = False) -> dict[str, list[str]]:
    """The gate ignore list per quantizer (`ignore.ignore_lists`) for every gate the package knows."""
    return quantizer_ignore_lists(gate_patterns(fused))


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


def sibling_groups(path: str) -> list[tuple[str, ...]]:
    """The `FUSED_SIBLINGS` groups `path` belongs to, as paths beside it."""
    parent, _, leaf = path.rpartition(".")
    return [tuple(f"{parent}.{name}" if parent else name for name in names) for names in FUSED_SIBLINGS if leaf in names]


def arms(model: nn.Module) -> dict[str, dict[str, torch.Tensor | None]]:
    """Arm name -> {path: rows} of the linear maps it rounds (rows: None for all, or the mask of those that round).
    A model without a gate of linear maps has the arm `all` alone."""
    linears = linear_paths(model)
    gates = {path: rows for path, rows in gate_rows(model).items() if path in linears}
    out = {"all": dict.fromkeys(linears)}
    if not gates:
        return out
    fused = {path: rows for path, rows in gates.items() if rows is not None}
    kept = set(gates) | {p for path in fused for group in sibling_groups(path) for p in group}
    out["gates_kept"] = {path: None for path in linears if path not in kept}
    out["gates_only"] = dict.fromkeys(gates)
    if fused:
        out["gate_rows_only"] = dict(fused)
        out["query_rows_only"] = {path: ~rows for path, rows in fused.items()}
    return out
