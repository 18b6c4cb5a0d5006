"""The configs of the three families, the gate spec and the named presets.

- `gate_spec`: `config.attn_gate`, a JSON-able dict; its keys and allowed
  values, `normalize_gate_spec` (aliases resolved, every key filled in) and
  the `ValueError` that names a wrong key.
- `gated_attention`: `GatedAttentionConfig`, the dense config with
  transformers' Llama/Qwen field names plus `qk_norm`, `sliding_window`,
  `qkv_bias` and the gate.
- `gated_attention_moe`: `GatedAttentionMoeConfig`, the dense config plus
  Qwen3-MoE's fields, a shared expert and the router z-loss.
- `gated_deltanet_hybrid`: `GatedDeltaNetHybridConfig`, the layer schedule
  (`layer_types` or `hybrid_ratio`) and the Gated DeltaNet fields under
  Qwen3-Next's names.
- `declared`: the configs of transformers' own models gated by declaration:
  `declared_config_class(Gemma2Config)` is `GatedGemma2Config`, the source's
  class plus `attn_gate`, saved under `model_type` "gated_declared" with the
  source's `source_model_type` (`GatedDeclaredConfig` reads it back).
- `tensor_parallel`: `tensor_parallel_plan(config)`, the `base_model_tp_plan`
  each config sets for its own gate and layers (transformers' tensor
  parallelism and vLLM's transformers backend read it).
- `validation`: `check_architecture`, the architecture fields of any
  `config.json` (ours, transformers' Llama/Qwen/MoE, fla's) checked before
  anything is allocated, one line naming the field and value. Standard
  library only.
- `presets`: named shapes from the two papers (`from_preset`), built without
  downloading anything.

Imports: `compat` only (see docs/architecture.md). The config modules are
copied into saved checkpoints as remote code with the models.
"""
