"""The memory budget: how a model larger than memory runs within `--max-memory` (or the memory free now).

- `budget`: `MemoryBudget`, what `--max-memory` (or, by default, the
  free memory) turns into for accelerate's big-model inference: its
  `max_memory` dict, `from_pretrained`'s placement arguments with a temporary
  offload folder, the one-line refusal of a budget below one layer, and the
  miniature run (`rehearse`) after which the process measures itself.
  `convert` verifies within it and `analysis` runs within it.

Parsing and printing sizes (`--max-memory 4GB`) is the command line's, in
`gated_attention/cli_common.py`.

Imports: `cli_common` only; torch, accelerate and psutil inside the functions. It sits above `hub`
and below `modeling`, beside `files` (see docs/architecture.md); `convert` and `analysis` use it.
"""
