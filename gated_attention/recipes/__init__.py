"""The recipes: `gated-attention quickstart` and its `--preset sinks`, built on the library.

- `settings`: what decides each recipe's numbers, as dataclasses (no torch), and
  their validation from the parsed flags;
- `cli`: the `quickstart` parser (imports no torch) and the dispatch to a recipe;
- `common`: device placement, the run's folder/cache/log (`Job`), the model pairs;
- `quickstart`: the main job (from scratch, and conversion + continued training);
- `sinks`: the paper's sink pair at a larger scale, per-layer metrics and probes;
- `report`: plain-text tables, CSV files and the plots drawn from them.

Each recipe's `run(args)` reads top-down as named steps: prepare the data,
build the models, train, measure, report. The recipes import the library
(`training`, `analysis`, `convert`, `modeling`); nothing imports them but the CLI.
"""
