"""The recipes: `gated-attention quickstart` and its presets (`sinks`, `trained`, `backcopy`, `stability`), built on
the library.

- `settings`: what decides each recipe's numbers, as dataclasses (no torch), the one table of which job
  reads which flag (`FLAGS`: the settings, the refusals and `--help` all read it);
- `cli`: the `quickstart` parser (imports no torch) and the dispatch to a recipe;
- `folders`: `--out`, checked before torch is imported and written whole or not at all (a staging folder
  renamed into place; a concurrent run refused), with `files.staging` (standard library only);
- `common`: device placement, the run (`Job`: its staged folder, cache, log), the models compared (`model_arms`:
  the same initial weights, each arm's config fields on top), and the training loop with probes between
  chunks that every preset shares (`train_with_probes`);
- `quickstart`: the main job (from scratch, and conversion + continued training);
- `sinks`: the paper's sink pair at a larger scale, per-layer metrics and probes;
- `trained`: the paper's experiment on a trained model (SmolLM2 from its GGUF): the
  exact G1 conversion trained beside the ungated source, sink and activation metrics
  before and after, long-text perplexity with and without YaRN;
- `backcopy_task`: the Bigram-Backcopy task (Guo et al. 2024): the sequences, the
  dormant/active split of their queries, the best possible loss, attention on the
  first token by query kind;
- `backcopy`: the ungated model and its G1 twin trained from scratch on that task,
  where a sink forms without the gate;
- `stability`: the ungated model, its G1 twin and a qk-norm twin from the same weights, each trained at
  every rate of a learning-rate sweep: divergence, loss spikes, attention and output logits, and each one's
  learning-rate sensitivity (Wortsman et al. 2023);
- `report`: plain-text tables, CSV files and the plots drawn from them;
- `quantize_cli` and `quantize`: `gated-attention quantize MODEL DST --scheme SCHEME`, the measured arm of
  `analyze --quantization` written as a compressed-tensors checkpoint (inputs read as `analyze` reads them,
  DST staged and checked as `convert` writes it).

Each recipe's `run(args)` reads top-down as named steps: prepare the data,
build the models, train, measure, report. The recipes import the library
(`training`, `analysis`, `convert`, `quantization`, `modeling`); nothing imports them but the CLI.
"""
