"""The tensor-parallel plan of a config: which parameters shard, and how.

transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")` or
`distributed_config=DistributedConfig(tp_size=N)`) and vLLM's transformers
backend both read `config.base_model_tp_plan`. The plan here follows
transformers' Qwen3 (attention, q/k norms), Qwen3-MoE (experts) and
Qwen3-Next (Gated DeltaNet layers), and adds what only our layers have:

- A per-head gate (`attn_gate` at G1..G4, not head-shared) is sharded like the
  projection whose heads it gates ("colwise": its scores split on the last
  dimension, heads first), so each rank scores its own heads. Left whole, a
  gate on the kv heads (G2/G3) would broadcast over a rank's heads without an
  error and give wrong numbers.
- A head-shared gate's scores are needed whole on every rank: it holds a shard
  of its weights and gathers its scores, and since each rank applies them to
  its own heads only, the gradient of the gathered scores is summed across
  ranks (`SHARDED_GATHERED_SUM_GRAD`, a style the model registers with
  transformers, which has none for this). A head-shared headwise gate has one
  score, too few to split: it stays whole, its output's gradient summed the
  same way (`REPLICATED_SUM_OUTPUT_GRAD`).
- A low-rank gate (`rank`) shards its second factor `attn_gate.up` as above and
  keeps `attn_gate.down` whole: each rank computes the same `rank` values, and
  the styles on `up` sum the gradient of its input across ranks, so `down`'s
  gradient is one process's without a rule of its own.
- A learned sink (`attention_sinks`) has one logit per query head: sharded with
  the heads ("colwise" on the bare parameter, as transformers' GraniteSWA); the
  attention reads this rank's slice.
- The G5 ("dense") gate acts on o_proj's output, which is whole on every rank
  after the rowwise all-reduce: it holds a shard of its weights and gathers its
  scores ("colwise_gather_output"), so it costs each rank 1/tp of its bytes.
- Per-head norms on sharded activations (`q_norm`, `k_norm`, the SDPA output
  norm) stay whole with their gradients summed, as in Qwen3.
- Gated DeltaNet projections hold a shard of their weights and gather their
  outputs ("colwise_gather_output", as Qwen3-Next): each rank runs the whole
  recurrence; its convolutions and decay parameters stay whole.

`tensor_parallel_plan(config)` is called by the configs' `__post_init__`, so
the plan always matches the config's gate and layers.
"""

from __future__ import annotations

from .gate_spec import GATE_NAME

# "colwise_gather_output" whose gathered output each rank uses on its own heads only, so the output's gradient is
# summed across ranks first (transformers has no such style; `modeling/tensor_parallel.py` registers it).
SHARDED_GATHERED_SUM_GRAD = "gated_attention_colwise_gather_output_sum_grad"
# The same for a module too small to shard: whole on every rank, its output's gradient summed across ranks.
REPLICATED_SUM_OUTPUT_GRAD = "gated_attention_replicated_sum_output_grad"
REPLICATED_SUM_PARAM_GRAD = "replicated_with_grad_allreduce"  # transformers' own, as in Qwen3's q_norm / k_norm

_ATTENTION = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
}
_MLP = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
_EXPERTS = {
    "mlp.experts.gate_up_proj": "packed_colwise",
    "mlp.experts.down_proj": "rowwise",
    "mlp.experts": "moe_tp_experts",
    "mlp.shared_expert.gate_proj": "colwise",
    "mlp.shared_expert.up_proj": "colwise",
    "mlp.shared_expert.down_proj": "rowwise",
}
_GATED_DELTANET = {
    f"linear_attn.{name}": "colwise_gather_output"
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
}


def gate_rule(spec: dict) -> str | None:
    """The style of `self_attn.attn_gate` for a normalised gate spec, or None when it needs none."""
    if spec["position"] is None:
        return None
    if spec["position"] == "dense":
        return "colwise_gather_output"
    if spec["head_shared"]:
        return SHARDED_GATHERED_SUM_GRAD if spec["granularity"] == "elementwise" else REPLICATED_SUM_OUTPUT_GRAD
    return "colwise"


def gate_plan_key(spec: dict) -> str:
    """The gate's module the plan shards, below the attention: the projection, or a low-rank gate's `up` (its
    `down` stays whole)."""
    return f"{GATE_NAME}.up" if spec["rank"] else GATE_NAME


def tensor_parallel_plan(config) -> dict[str, str]:
    """`base_model_tp_plan` for a dense, MoE or hybrid config (names relative to the base model).

    Only rules for modules the config builds: transformers warns about a rule that matches nothing.
    """
    layers = range(config.num_hidden_layers)
    sparse = [config.is_sparse_layer(i) for i in layers] if hasattr(config, "is_sparse_layer") else [False] * len(layers)
    rules: dict[str, str] = {}
    if any(t != "linear_attention" for t in config.layer_types):
        rules |= _ATTENTION
        if config.qk_norm:
            rules |= {"self_attn.q_norm": REPLICATED_SUM_PARAM_GRAD, "self_attn.k_norm": REPLICATED_SUM_PARAM_GRAD}
        if config.attn_output_norm is not None:
            rules["self_attn.attn_output_norm"] = REPLICATED_SUM_PARAM_GRAD
        if (style := gate_rule(config.attn_gate)) is not None:
            rules[f"self_attn.{gate_plan_key(config.attn_gate)}"] = style
        if config.attention_sinks:
            rules["self_attn.sinks"] = "colwise"
    if "linear_attention" in config.layer_types:
        rules |= _GATED_DELTANET
        if not config.linear_output_gate:
            del rules["linear_attn.g_proj"]
    if not all(sparse):
        rules |= _MLP
    if any(sparse):
        rules |= _EXPERTS
        if not config.shared_expert_intermediate_size:
            rules = {name: style for name, style in rules.items() if ".shared_expert." not in name}
    return {f"layers.*.{name}": style for name, style in rules.items()}
