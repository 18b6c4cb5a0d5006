"""The ignore lists that keep a model's gates out of another quantizer's recipe, as text.

Three forms, one per family of quantizers: llm-compressor's and compressed-tensors' `ignore` ("re:" + a Python
regex of the module path), Model-Optimizer's `quant_cfg` keys (fnmatch wildcards of the path) and GPTQModel's
`dynamic` keys ("-:" + a regex, to skip). No model is needed: the cards `convert` and `export` write carry them
without importing the models (`targets.gate_patterns` adds the output gates transformers ships).
"""

from __future__ import annotations

OWN_GATE = r".*\.attn_gate(\..*)?$"  # our attn_gate: its `proj`, or a low-rank gate's `down` and `up`
# A gate fused into `q_proj` (Qwen3.5, Qwen3-Next, `export --format qwen3_5`) is kept by keeping that `q_proj`, which
# holds the query too (a quantizer rounds a tensor whole), and the `k_proj` and `v_proj` vLLM fuses it with (it
# refuses a fused layer whose parts are kept and rounded unlike).
FUSED_GATE = r".*\.self_attn\.[qkv]_proj$"


def ignore_lists(patterns: list[str]) -> dict[str, list[str]]:
    """What each quantizer skips to keep the modules whose paths match `patterns`, and `lm_head`, which none of
    them rounds by default either: `llm-compressor` (also compressed-tensors), `modelopt`, `gptqmodel`."""
    return {
        "llm-compressor": ["lm_head", *(f"re:{p}" for p in patterns)],
        "modelopt": ["*lm_head*", *(_wildcard(p) for p in patterns)],
        "gptqmodel": [f"-:{p}" for p in patterns],
    }


def ignore_section(patterns: list[str], what: str = "every gate module") -> str:
    """A model card's paragraph on keeping the gates out of another quantizer: one line per tool."""
    return ("To quantize this checkpoint and keep its gates in full precision, give the quantizer this list of what "
            f"to skip ({what}):\n\n" + "\n".join(f"- {tool}: `{value}`" for tool, value in ignore_lists(patterns).items()))


def _wildcard(pattern: str) -> str:
    """A path regex of this module's form as Model-Optimizer's fnmatch key."""
    text = pattern.removesuffix("$").replace(r"(\..*)?", "*").replace(".*", "*").replace(r"\.", ".")
    return text.replace("\\", "")
