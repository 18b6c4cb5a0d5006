"""`gated-attention convert | extend | export`: checkpoints in, checkpoints out, DST whole or not at all.

- `cli`: the three parsers (no torch), and the checks that need no file
  content, before the work starts.
- `errors`: `ConversionError`, bad input as one readable line.
- `folders`: SRC and DST on disk; the staging folder that becomes DST only
  when it is complete. Standard library only.
- `sources`: reading a source checkpoint (folder or Hub id) one tensor at a
  time, header checks, the inf/NaN scan.
- `quantized`: a quantized source (transformers' block FP8, compressed-tensors' FP8 / INT8 / W4A16) read
  dequantized one weight at a time, and the dequantizing load the verification runs SRC with.
- `families`: the source families (`FAMILIES`), one declarative record each
  (defaults, aliases, derived fields, reader, target fields, what it cannot
  express, weight rules), and which one a config.json is. A new family is a
  new record and its test.
- `source_config`: the records' readers: a source config.json read as its
  transformers class (`SourceConfig`) or fla (`FlaHybridSource`) reads it,
  without importing that class.
- `targets`: a source config mapped onto our dense, MoE or hybrid config.
- `declared`: any other causal LM transformers ships, converted in its own
  class with the gate added by declaration (`modeling/declared.py`): its
  config and meta model, an `AddGate` rule per attention module, the
  verification in its own classes, what is refused.
- `shapes`: the tensor names and shapes a target model expects.
- `plan`: the weight rules (`Rename`, `Split`, `SplitRows`, `FuseExperts`, `AddGate`, ...),
  each applied the same way, and the weight plan, every output tensor named,
  shaped and checked.
- `rope`: the RoPE base change and YaRN, as `rope_parameters`.
- `writer`: `OutputTensor` and the streamed, sharded safetensors writer;
  copying tokenizer and other side files.
- `pipeline`: the write sequence all three commands share (resolve, check,
  plan, the memory budget, check finite, staged write, config, side files,
  card, verify).
- `convert`: `convert_checkpoint` and `extend_checkpoint`: how they read SRC
  and plan their outputs.
- `export`: `export_checkpoint`, a gated model as transformers' native Qwen3.5
  where every piece maps exactly.
- `export_layouts`: what `export` writes for each engine, as records: the
  weight rules (`WeightRule`, `ZeroFill`) and the config layouts (`text`,
  `mlx`), and what mlx-lm cannot run.
- `verify`: source and result run one after the other on a fixed prompt,
  within the memory budget, compared after every layer.
- `card`: the model cards the commands write.

The steps these follow are in docs/architecture.md ("The conversion
pipeline"). Imports: the package root, `configuration`, `hub`, `files`, `memory`,
`cli_common` and `compat`;
never `training`, `analysis` or `recipes`. Models are reached through the Auto
classes, and only where a config alone is not enough.
"""
