"""Training: the loop shared by the recipes and `examples/`, and the data it reads.

- `loop`: optimizer groups (gates at their own learning rate), the training
  loop with the gate-score meter, (seed, step)-addressed batches, evaluation
  and the final save. Its names are re-exported here:
  `from gated_attention.training import train, TrainConfig`.
- `checkpoints`: accelerate checkpoints, staged and renamed into place when
  whole, checked file by file before a resume; the run's `log.jsonl` (one
  record per step, also across resumes); Ctrl-C as one line naming the last
  complete checkpoint. Re-exported here too.
- `data`: the embedded corpora (Python's own docs and sources; the package
  corpus), the byte-level BPE tokenizer trained on them, packing into BOS-led rows.
- `streaming`: Hugging Face `datasets` streams packed on the fly, and token shards.
- `folders`: output folders that a failed run removes again while they are empty, `final/` staged and
  renamed when whole, what killed saves left cleared at the next start, a full disk during a save as one
  line (`DiskFullError`), and what a rerun with `--overwrite` removes (`RUN_ENTRIES`).
- `threads`: the default count of torch CPU threads (the cores the load average leaves free).

Of this package it imports only `files` (the `--dataset` reader, output and staging folders),
`cli_common` (errors as one line), the package's `GatedAttentionWarning`, and the gate's name and classes
(`configuration.gate_spec.GATE_NAME`, `modeling.attention.GATE_CLASSES`): it works on any causal LM (ours,
transformers', a PEFT wrapper), and the recipes and examples build on it.
"""

from .checkpoints import (
    CheckpointError,
    Interrupted,
    RunLog,
    check_checkpoint,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    reporting_interruption,
    save_checkpoint,
)
from .loop import (
    GATE_KEY,
    GateScoreMeter,
    RowBatches,
    StepBatches,
    StreamBatches,
    TrainConfig,
    check_finite_weights,
    evaluate_loss,
    finish_training,
    gate_modules,
    gate_parameters_snapshot,
    is_gate_parameter,
    make_optimizer,
    make_scheduler,
    optimizer_groups,
    save_final,
    train,
    with_rope,
)

__all__ = [
    "GATE_KEY", "CheckpointError", "GateScoreMeter", "Interrupted", "RowBatches", "RunLog", "StepBatches",
    "StreamBatches", "TrainConfig", "check_checkpoint", "check_finite_weights", "checkpoint_dir", "evaluate_loss",
    "finish_training", "gate_modules", "gate_parameters_snapshot", "is_gate_parameter", "latest_checkpoint",
    "load_checkpoint", "make_optimizer", "make_scheduler", "optimizer_groups", "reporting_interruption",
    "save_checkpoint", "save_final", "train", "with_rope",
]
