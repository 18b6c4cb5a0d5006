"""The models: gated softmax attention, the MoE block, the Gated DeltaNet mixer and the three families.

- `attention`: `GatedAttention`, Llama's attention (Qwen3's with `qk_norm`) with
  the gate at any position G1..G5 as its own module `attn_gate` (full,
  low-rank or constant; reading all of its input or its first channels), and
  the paper's two non-gate ablations.
- `attention_sinks`: GPT-OSS's learned per-head sink logit (`self_attn.sinks`),
  the attention function that applies it per `attn_implementation`, and the
  refusal for one that would drop it.
- `base`: what every family shares: `GatedPreTrainedModel` (the gate's init,
  the remote-code bundle written by `save_pretrained`, the tensor-parallel
  shape check at load) and `GatedForCausalLM`, the causal-LM head over a
  family's `model_class`.
- `tensor_parallel`: the two tensor-parallel styles the config's plan names
  for head-shared gates (registered with transformers on import) and the
  check that the heads split over the ranks.
- `packing`: finding the sequences of packed rows (restarting `position_ids`,
  flash-attention's `cu_seq_lens_q`), and refusing rows that cannot be split.
- `gated_attention`: the dense family (`GatedAttentionModel`,
  `GatedAttentionForCausalLM`), Llama's layout and parameter names, and the
  pre-norm decoder block the other families fill with their own mixer or MLP.
- `moe`: the sparse MoE block, transformers' Qwen3-MoE block with an optional
  gated shared expert and Mixtral's fp32 routing weights.
- `load_balancing`: the router losses (load balancing, z-loss) and
  `GlobalLoadBalancer`, which counts experts over the global batch. Torch only.
- `gated_attention_moe`: the MoE family, the dense model with sparse MLPs, and
  the parts any family with sparse layers takes from it: `sparse_or_dense_mlp`,
  `SparseExpertsMixin` (the experts' init) and `RouterLossesForCausalLM` (the
  causal-LM head with the router losses).
- `gated_deltanet`: the Gated DeltaNet mixer with fla's parameter names and its
  conv and recurrent cache states.
- `gated_deltanet_hybrid`: the hybrid family, Gated DeltaNet layers
  interleaved with the shared gated attention; built from the dense family's
  block and model and the MoE family's sparse parts, never from its classes.
- `sink_cache`: `SinkCache`, StreamingLLM's windowed KV cache (the first
  tokens kept as attention sinks, the rest a sliding window) for any causal
  LM of this package and transformers' rotate-half RoPE models, the sink keys
  re-rotated for the shifted window.
- `recorded_outputs`: what a transformers model declares in
  `_can_record_outputs` (its hidden-state and attention modules), merged over
  its submodels, and which declared attention classes compute no softmax
  (`NOT_SOFTMAX`): the one reader `attention_sites` and the analysis share;
  beside it the one record of what both commands read (the classes older than
  the declaration, `LEGACY_DECLARATIONS`; the refused types, `REFUSED`) and
  which transformers class serves a model type (`transformers_classes`).
- `gate_sites`: where an attention module's output gate is, for every gate the
  package reads (ours, the output gates transformers ships, Qwen3.5's rows of
  `q_proj`, learned sinks) and which linear rows hold it: the one rule the
  analysis and the quantization share.
- `attention_sites`: where a transformers model's softmax-attention modules
  and their output projections are, read from its own declarations
  (`recorded_outputs`, its tensor-parallel plan), or one line saying what
  is missing.
- `declared`: transformers' own model classes with the gate added at
  construction (`GatedGemma2ForCausalLM`, ...): a gate module `attn_gate` on
  each attention, applied by hooks to its output projection's input.

Imports: `configuration`, `kernels`, `hub` and `compat`, nothing above them
(see docs/architecture.md). These files are also copied flat into every saved
checkpoint as remote code, so they import each other only as `from .x import y`
or `from ..part.x import y`, and optional packages only inside `try:`.
Nothing is re-exported here: the public classes come from `gated_attention`.
"""
