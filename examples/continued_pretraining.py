"""Continued pretraining of a causal LM (typically a converted gated one) with `accelerate launch`.

    accelerate launch --config_file examples/configs/ddp.yaml examples/continued_pretraining.py \
        --model ./llama-gated --output-dir runs/cpt --text-files data/ \
        --seq-len 2048 --batch-size 4 --grad-accum 8 --steps 2000 --lr 2e-5 --gate-lr 1e-3

Any causal LM folder or Hub id works (`import gated_attention` registers the
gated types; `--trust-remote-code` for others that need it).

Data, packed into `--seq-len` rows that each start with BOS (documents joined by EOS):
- `--dataset`: a corpus of any size, streamed through HF `datasets` and
  tokenized on the fly (`gated_attention.training.streaming`): jsonl/json, parquet, csv
  or txt files (or a folder of them), a `save_to_disk` folder, or a Hub dataset
  id (read from the local cache, so offline once cached); `--text-field` names
  the text column. Each process reads its own part; memory stays flat. Or a
  folder written by `examples/tokenize_corpus.py` (token shards, memory-mapped,
  rows shuffled like the in-memory path).
- `--text-files` (folders mean every *.txt), or the embedded corpus of
  `gated_attention.training.data` when neither is given: tokenized in memory, rows shuffled.

Gate parameters (names containing `attn_gate`) train at `--gate-lr`, the rest
at `--lr`: a converted model's gates start at weight 0 (score exactly 0.5),
and at a continued-pretraining learning rate they may barely move (issue #10
of the Gated Attention paper's official repository). The log shows the mean gate score, so you can see whether they do.

Several processes on a CPU-only machine (a try-out; `--cpu --num_processes 2`
starts one process unless MPI is set up): `accelerate launch --multi_gpu
--num_processes 2 examples/continued_pretraining.py ...` (the script picks the
CPU and gloo itself).

Checkpoints (`--save-every`) are `accelerator.save_state` folders under
OUTPUT/checkpoints, each written as checkpoints/.step-N.incomplete-PID and
renamed when whole, so a Ctrl-C or a crash during a save leaves the earlier
checkpoints as they were (`gated_attention.training.checkpoints`). `--resume
latest` (the newest complete checkpoint) or a checkpoint folder continues at the
saved step with the same data order: in memory and from token shards the batch
of step s is a function of (seed, s) only (see `gated_attention.training.StepBatches`);
a stream's position (not its data) is saved in the checkpoint, one small JSON
per process. A damaged checkpoint file (cut short) is one line naming it and an
earlier checkpoint. Every line of OUTPUT/log.jsonl has the step's batch digest,
one line per step: a resume from an earlier step replaces the records of the
steps it trains again. Ctrl-C prints `interrupted; the last complete checkpoint
is ...` and exits with status 130. Run
with the same number of processes, batch size and accumulation to keep the order. The final model is
saved with `save_pretrained` in OUTPUT/final (with the remote-code bundle for
gated models) together with the tokenizer, written as OUTPUT/.final.incomplete-PID
and renamed when whole; weights that are not finite (a run that diverged) are
never saved, as a checkpoint or as final/: the run stops with one line naming the step. final/ has a
model card naming `--model` as its base (`base_model_relation: finetune`, its license and commit;
docs/models.md), and `--push-to-hub REPO_ID [--private]` uploads final/ in one commit once the run is
done (lora_finetune.py: merged/, after its reload check); a refused push is one line, final/ stays.

An OUTPUT that already holds a run (log.jsonl, checkpoints/, final/, ...) is
continued with `--resume`, or replaced with `--overwrite` (which removes only
the run's own entries); otherwise it is refused, as is an OUTPUT that holds
other files, is the working folder or lies in `--model`'s folder.

Inputs are checked before a model is loaded or OUTPUT is made (`check_inputs`):
the data exist and hold text, `--model` is a causal LM, and `--seq-len` fits in
its `max_position_embeddings` (longer needs a RoPE change first:
`long_context.py`, `gated-attention extend`). A bad one is one line on stderr and
exit status 2; a run that fails later removes the folders it made while they are
still empty (`training.folders.output_folder`). On a CPU-only machine torch uses
the cores the load average leaves free (`--threads` to choose).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

import gated_attention  # noqa: F401 - registers the gated model types with the Auto classes
from gated_attention.cli_common import OneLineErrorParser, add_push_to_hub, bounded, first_line
from gated_attention.training.data import packed_rows, spread_rows, text_file_paths, tokenizer_for
from gated_attention.files.datasets import DataError
from gated_attention.training.streaming import TokenShards, check_corpus, is_token_shards, open_corpus, text_stream
from gated_attention.training.folders import RUN_ENTRIES, DiskFullError, output_folder, remove_run
from gated_attention.configuration.validation import ConfigError, check_architecture, check_config_file
from gated_attention.files.output_folders import OutputFolderError, check_output_folder, holds_any
from gated_attention.training.threads import set_cpu_threads
from gated_attention.hub.loading import from_pretrained_checked
from gated_attention.hub.model_card import write_training_card
from gated_attention.hub.push import PushFailed, push_folder, push_problem
from gated_attention.hub.repo_ids import missing_folder
from gated_attention.training import (
    CheckpointError,
    Interrupted,
    RunLog,
    TrainConfig,
    evaluate_loss,
    finish_training,
    latest_checkpoint,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    reporting_interruption,
    save_checkpoint,
    save_final,
    train,
)

RUN = "a run of these examples (log.jsonl, checkpoints/, final/)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser(description: str = __doc__.split("\n")[0], **defaults) -> argparse.ArgumentParser:
    count, rate, non_negative = bounded(int, 1), bounded(float, 0, strict=True), bounded(float, 0)
    p = OneLineErrorParser(description=description)
    p.add_argument("--model", required=True, help="causal LM folder or Hub id")
    p.add_argument("--output-dir", required=True, help="created once the inputs have been checked")
    p.add_argument("--dataset", nargs="+", metavar="SPEC",
                   help="streamed corpus: jsonl/json/parquet/csv/txt files or a folder of them, a save_to_disk "
                        "folder, a Hub dataset id (from the local cache), or a token-shard folder")
    p.add_argument("--text-field", default="text", help="the text column of --dataset / --valid-dataset")
    p.add_argument("--split", help="split of a --dataset folder, saved dataset or Hub id (default: train; a dataset "
                   "saved alone: itself)")
    p.add_argument("--valid-dataset", nargs="+", metavar="SPEC",
                   help="validation corpus like --dataset (its first --eval-sequences rows)")
    p.add_argument("--text-files", nargs="+", help="training text files or folders (default: the embedded corpus)")
    p.add_argument("--valid-files", nargs="+",
                   help="validation text (default: the embedded corpus's validation split; none with --dataset)")
    p.add_argument("--seq-len", type=bounded(int, 2), default=512,
                   help="tokens per packed row, BOS included (at most the model's max_position_embeddings)")
    p.add_argument("--batch-size", type=count, default=8, help="rows per process and micro-step")
    p.add_argument("--grad-accum", type=count, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=count, default=1000, help="optimizer steps in total")
    p.add_argument("--lr", type=rate, default=2e-5, help="learning rate of all non-gate parameters")
    p.add_argument("--gate-lr", type=rate, default=1e-3, help="learning rate of parameters named *attn_gate*")
    p.add_argument("--train", choices=["all", "gates"], default="all",
                   help="all (default): every parameter; gates: the attn_gate parameters alone, the rest frozen")
    p.add_argument("--attn-implementation", metavar="NAME",
                   help="attention implementation to load --model with (eager, sdpa, ...; default: the model's own)")
    p.add_argument("--weight-decay", type=non_negative, default=0.1)
    p.add_argument("--warmup-steps", type=bounded(int, 0), default=None, help="default: 5%% of --steps")
    p.add_argument("--max-grad-norm", type=non_negative, default=1.0, help="0: no clipping")
    p.add_argument("--seed", type=bounded(int, 0), default=0)
    p.add_argument("--save-every", type=bounded(int, 0), default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", help="'latest' (in --output-dir) or a checkpoint folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output-dir (its log.jsonl, checkpoints/, final/, ...; other "
                        "files there stay); without it, or --resume, an --output-dir that holds a run is refused")
    p.add_argument("--eval-sequences", type=bounded(int, 0), default=32,
                   help="validation rows, evenly spaced over the validation text, evaluated before and after "
                        "training (0: none)")
    p.add_argument("--max-chars", type=count, help="use only a prefix of the embedded corpus (characters)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="weights' dtype (mixed precision comes from the accelerate config)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--threads", type=count, help="torch CPU threads on a CPU-only machine (default: the cores the "
                   "1-minute load average leaves free; OMP_NUM_THREADS if set, as accelerate launch sets it)")
    p.add_argument("--log-every", type=count, default=10)
    p.add_argument("--no-progress", action="store_true")
    add_push_to_hub(p, "the saved model")
    p.set_defaults(**defaults)
    return p


class InputError(ValueError):
    """A `--model` or flag that this run cannot use; the message is one line meant for the user."""


def check_model(args):
    """The config of `--model`, read (not the weights) to check that it is a causal LM; `InputError` if not."""
    name = args.model
    if missing_folder(name):  # no such path, and no Hub repo id either
        raise InputError(f"--model {name}: no such folder")
    try:  # the raw config.json first: transformers' own check of a bad value names no field
        check_config_file(name, f"--model {name} config.json")
        config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        check_architecture(config, f"--model {name}")  # a Hub id's, now downloaded
    except ConfigError as e:
        raise InputError(str(e)) from None
    except (OSError, ValueError) as e:
        raise InputError(f"--model {name}: {first_line(e)}") from None
    remote = args.trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote:
        raise InputError(f"--model {name}: a {config.model_type!r} model ({type(config).__name__}) is not a causal LM "
                         "(transformers' AutoModelForCausalLM has no class for it)")
    return config


def check_output_dir(args) -> None:
    """`--output-dir` may hold nothing but an earlier run of these examples (`RUN_ENTRIES`), and may not be the
    working folder, above it, or `--model`'s folder (see `gated_attention.files.output_folders`). One that
    holds a run is continued (`--resume`) or replaced (`--overwrite`, in `run_training`), never trained
    into again from step 1 by accident."""
    model = Path(args.model).expanduser()
    try:
        check_output_folder(args.output_dir, flag="--output-dir", what=RUN, ours=holds_any(*RUN_ENTRIES),
                            inputs={"--model": model if model.exists() else None})
    except OutputFolderError as e:
        raise InputError(str(e)) from None
    if args.overwrite and args.resume:
        raise InputError("--overwrite replaces the run in --output-dir and --resume continues it: give one of them")
    held = [name for name in RUN_ENTRIES if os.path.lexists(Path(args.output_dir) / name)]
    if held and not (args.resume or args.overwrite):
        raise InputError(f"--output-dir {args.output_dir} already holds a run ({held[0]}); pass --resume latest to "
                         "continue it, or --overwrite to replace it")


def check_inputs(args, *, rope_change: bool = False):
    """Check what can be checked before a model is loaded or a folder is made; returns the model's config.

    `--output-dir` must be new, empty or an earlier run (`check_output_dir`),
    `--model` must be a causal LM, `--seq-len` must fit in its positions unless the
    run changes RoPE for a longer context (`rope_change`, as long_context.py does),
    and the data must exist: files and folders, and for `--dataset` the text column
    with some text in it (checked first: reading the data needs no model).
    """
    for flag, paths in (("--text-files", args.text_files), ("--valid-files", args.valid_files)):
        if paths:
            try:
                text_file_paths(paths)
            except FileNotFoundError as e:
                raise DataError(f"{flag} {e}") from None
    for spec in (args.dataset, args.valid_dataset):
        if spec and not (len(spec) == 1 and is_token_shards(spec[0])):
            corpus = open_corpus(spec[0] if len(spec) == 1 else spec, args.split)
            check_corpus(corpus, args.text_field, " ".join(spec))
    if problem := push_problem(args):
        raise InputError(problem)
    check_output_dir(args)
    config = check_model(args)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and args.seq_len > positions and not rope_change:
        raise InputError(f"--seq-len {args.seq_len} is longer than {args.model}'s max_position_embeddings ({positions}): "
                         f"it was never trained at those positions. Use --seq-len {positions} or less, or extend the "
                         "context first (examples/long_context.py, `gated-attention extend`)")
    return config


def make_accelerator() -> Accelerator:
    """An Accelerator that uses the CPU (gloo) when the machine has no accelerator.

    Without `cpu=True`, processes started by `accelerate launch --multi_gpu` on a
    CPU-only machine would each train alone (DistributedType.NO), silently.
    """
    return Accelerator(cpu=not torch.accelerator.is_available())


def set_threads(args, accelerator) -> None:
    """On the CPU, torch's threads: `--threads`, else what `set_cpu_threads` finds free (a busy machine
    slows several threads down far more than one)."""
    if accelerator.device.type == "cpu":
        threads, why = set_cpu_threads(args.threads)
        accelerator.print(f"{threads} torch thread(s) per process ({why})")


def load_tokenizer(args, config):
    """The model's tokenizer, or the embedded one for a model folder without one (see `tokenizer_for`)."""
    try:
        return tokenizer_for(args.model, vocab_size=config.vocab_size, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"--model {args.model}: no usable tokenizer ({first_line(e)})") from None


def load_model(args, **overrides):
    """`--model`'s weights (`overrides`: config fields, e.g. other RoPE parameters); weights that do not fit its
    config (a tensor missing, unexpected or of another shape) are refused in one line, not trained."""
    if getattr(args, "attn_implementation", None):
        overrides["attn_implementation"] = args.attn_implementation
    try:
        model = from_pretrained_checked(AutoModelForCausalLM, args.model, dtype=DTYPES[args.dtype],
                                        trust_remote_code=args.trust_remote_code, **overrides)
    except (OSError, ValueError, ImportError) as e:
        raise InputError(f"--model {args.model}: {first_line(e)}") from None
    if getattr(args, "train", "all") == "gates":
        if not gate_parameter_count(model):
            raise InputError(f"--train gates: {args.model} has no attention gate (no parameter named *attn_gate*); "
                             "convert it first (gated-attention convert)")
        for name, p in model.named_parameters():
            p.requires_grad_("attn_gate" in name)
    return model


def open_dataset(spec: list[str], args, tokenizer, accelerator, seq_len: int):
    """Token shards (row-indexable) or this process's `PackedStream` of a `--dataset` spec."""
    if len(spec) == 1 and is_token_shards(spec[0]):
        return TokenShards(spec[0], seq_len, tokenizer)
    return text_stream(spec if len(spec) > 1 else spec[0], tokenizer, seq_len, text_field=args.text_field,
                       split=args.split, rank=accelerator.process_index, world=accelerator.num_processes)


def load_data(args, tokenizer, accelerator, seq_len: int | None = None):
    """(train data, validation rows `[N, seq_len]` or None); the main process fills the corpus cache first.

    The train data are packed rows `[N, seq_len]` (in memory or token shards) or a stream.
    """
    seq_len = seq_len or args.seq_len
    with accelerator.main_process_first():
        if args.dataset:
            train_rows = open_dataset(args.dataset, args, tokenizer, accelerator, seq_len)
        else:
            train_rows = packed_rows(tokenizer, seq_len, text_files=args.text_files, split="train",
                                     max_chars=args.max_chars)
        valid_rows = None
        if args.eval_sequences and args.valid_dataset:
            valid = open_dataset(args.valid_dataset, args, tokenizer, _OneProcess(), seq_len)
            valid_rows = (valid[: min(len(valid), args.eval_sequences)] if isinstance(valid, TokenShards)
                          else valid.next_rows(args.eval_sequences))
        elif args.eval_sequences and (args.valid_files or not args.dataset):
            valid_rows = spread_rows(packed_rows(tokenizer, seq_len, text_files=args.valid_files, split="validation",
                                                 max_chars=args.max_chars), args.eval_sequences)
    named = {"train": (("--dataset", args.dataset), ("--text-files", args.text_files)),
             "validation": (("--valid-dataset", args.valid_dataset), ("--valid-files", args.valid_files))}
    for split, rows in (("train", train_rows), ("validation", valid_rows)):
        if rows is not None and not hasattr(rows, "next_rows") and len(rows) == 0:
            source = next((f"{flag} {' '.join(v)}" for flag, v in named[split] if v), f"the embedded {split} split")
            raise DataError(f"{source}: too little text for one row of {seq_len} tokens")
    return train_rows, valid_rows


class _OneProcess:
    """Stands in for the accelerator where every process reads all of a (validation) corpus."""

    process_index, num_processes = 0, 1


def describe_data(train_rows, seq_len: int) -> str:
    if hasattr(train_rows, "next_rows"):
        return f"streaming {train_rows.name} in rows of {seq_len} tokens"
    return f"{len(train_rows):,} training rows of {seq_len} tokens"


def exit_on_input_error(main):
    """Run `main`; a model, corpus or `--resume` checkpoint that cannot be used ends the process with one
    line on stderr and exit status 2, and so do a loss that stops being finite and a save that fills the disk. Ctrl-C (or SIGTERM) ends
    it with one line, `interrupted; the last complete checkpoint is ...` (`training.reporting_interruption`),
    and exit status 130, as a shell reports a process ended by SIGINT; other processes of the run say nothing."""

    def run(argv: list[str] | None = None):
        try:
            return main(argv)
        except (InputError, DataError, CheckpointError, DiskFullError, FloatingPointError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt as e:
            if int(os.environ.get("RANK", "0")) == 0:  # torchrun's global rank; one process alone has none
                print(str(e) if isinstance(e, Interrupted) else "interrupted", file=sys.stderr)
            raise SystemExit(130) from None

    return run


def model_card(args, script: str, summary: str, relation: str = "finetune", **options):
    """`card(stage)` for `save_final`: the saved model's card, `--model` its base (`hub.model_card`)."""
    data = " ".join(args.dataset) if args.dataset else " ".join(args.text_files or []) or "the embedded corpus"
    rows = {"--model": args.model, "data": data, "--steps": args.steps, "--seq-len": args.seq_len,
            "--batch-size x --grad-accum": f"{args.batch_size} x {args.grad_accum}", "--lr": args.lr,
            "--gate-lr": args.gate_lr, "--train": args.train, "--dtype": args.dtype, **options}
    return lambda stage: write_training_card(stage, args.model, relation=relation, title=f"{Path(args.model).name}, "
                                             f"trained by {script}", summary=summary, options=rows,
                                             command=f"examples/{script}", version=gated_attention.__version__)


def push_saved(args, folder: Path, script: str) -> None:
    """`--push-to-hub`: the saved model folder, whole and checked by now, in one commit (the main process only,
    after the others are done). A failed push is one line and exit status 2; the folder stays as it is."""
    if not args.push_to_hub:
        return
    try:
        url = push_folder(folder, args.push_to_hub, private=args.private,
                          command=f"examples/{script} --model {args.model}")
    except PushFailed as e:
        raise InputError(str(e)) from None
    print(f"pushed {folder} to {url}")


def gate_parameter_count(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "attn_gate" in n and p.requires_grad)


def run_training(args, model, train_rows, accelerator, desc: str = "train", valid_rows=None):
    """Prepare, optionally resume, train with checkpoints and a JSONL log. Returns the prepared model.
    With `valid_rows`, a run that starts at step 0 evaluates them first (the baseline the end compares with)."""
    out = Path(args.output_dir)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        gate_lr=args.gate_lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, seed=args.seed,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20),
        log_every=args.log_every,
    )
    # Model and optimizer are prepared together: under FSDP2 accelerate shards the model and then
    # swaps the sharded parameters into the optimizer's groups (so the gate group keeps its rate);
    # it refuses a model prepared alone.
    optimizer = make_optimizer(model, config.lr, config.gate_lr, config.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not `prepare`d: accelerate would step it once per process per step. Registered so that
    # save_state / load_state carry it.
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps)
    accelerator.register_for_checkpointing(scheduler)

    if args.overwrite:  # the earlier run goes only now that every input has been checked and loaded
        if accelerator.is_main_process:
            removed = remove_run(out)
            if removed:
                print(f"--overwrite: removed the earlier run's {', '.join(removed)} from {out}", flush=True)
        accelerator.wait_for_everyone()

    start = 0
    if args.resume:
        folder = latest_checkpoint(out) if args.resume == "latest" else Path(args.resume)
        if folder is None:
            accelerator.print(f"no checkpoint in {out}/checkpoints: starting at step 0")
        else:
            start = load_checkpoint(accelerator, folder, data=train_rows)
            accelerator.print(f"resumed from {folder} at step {start}")

    if valid_rows is not None and start == 0:
        loss = evaluate_loss(model, valid_rows, args.batch_size, accelerator)
        accelerator.print(f"validation before training: loss {loss:.4f}, perplexity {math.exp(loss):.3f} "
                          f"({len(valid_rows)} rows)")

    # One record per step: a resume from an earlier checkpoint replaces the records of the steps it trains again.
    log = RunLog(out / "log.jsonl") if accelerator.is_main_process else None

    def on_step(step: int, record: dict) -> None:
        if accelerator.is_main_process:
            log.write(record)
            if step % args.log_every == 0 or step == config.steps:
                gate = "" if math.isnan(record["gate_score"]) else f"  gate {record['gate_score']:.4f}"
                print(f"step {step}/{config.steps}  loss {record['loss']:.4f}{gate}  lr {record['lr']:.3g}  "
                      f"gate_lr {record['gate_lr']:.3g}  batch {record['batch']}", flush=True)
        if (args.save_every and step % args.save_every == 0) or step == config.steps:
            save_checkpoint(accelerator, out, step, data=train_rows, model=model)

    train(model, train_rows, config, optimizer, scheduler, accelerator=accelerator, start_step=start,
          on_step=on_step, desc=desc, progress=not args.no_progress)
    return model


@exit_on_input_error
def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    with reporting_interruption(args.output_dir):
        return continued_pretraining(args)


def continued_pretraining(args):
    """The run, once the flags are parsed (`main` adds what Ctrl-C prints)."""
    config = check_inputs(args)
    accelerator = make_accelerator()
    set_threads(args, accelerator)
    set_seed(args.seed)
    tokenizer = load_tokenizer(args, config)
    train_rows, valid_rows = load_data(args, tokenizer, accelerator)
    model = load_model(args)
    accelerator.print(f"model {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, "
                      f"{gate_parameter_count(model):,} in gates; {describe_data(train_rows, args.seq_len)}; "
                      f"{accelerator.num_processes} process(es)")

    with output_folder(args.output_dir) as out:
        model = run_training(args, model, train_rows, accelerator, desc="continued pretraining", valid_rows=valid_rows)
        if valid_rows is not None:
            loss = evaluate_loss(model, valid_rows, args.batch_size, accelerator)
            accelerator.print(f"validation: loss {loss:.4f}, perplexity {math.exp(loss):.3f} ({len(valid_rows)} rows)")
        save_final(accelerator, model, out / "final", tokenizer, step=args.steps, card=model_card(
            args, "continued_pretraining.py", f"{args.model} after {args.steps} steps of continued pretraining."))
    accelerator.print(f"saved {out / 'final'}")
    model = accelerator.unwrap_model(model)  # the DDP/FSDP wrapper goes before the process group (finish_training)
    main_process = accelerator.is_main_process
    finish_training(accelerator)
    if main_process:
        push_saved(args, out / "final", "continued_pretraining.py")
    return model


if __name__ == "__main__":
    main()
