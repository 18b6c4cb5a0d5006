"""Continued pretraining of a causal LM (typically a converted gated one) with `accelerate launch`.

    accelerate launch --config_file examples/configs/ddp.yaml examples/continued_pretraining.py \
        --model ./llama-gated --output-dir runs/cpt --text-files data/ \
        --seq-len 2048 --batch-size 4 --grad-accum 8 --steps 2000 --lr 2e-5 --gate-lr 1e-3

Any causal LM folder or Hub id works (`import gated_attention` registers the
gated types; `--trust-remote-code` for others that need it). Data: plain-text
files (`--text-files`, folders mean every *.txt), or the embedded corpus of
`gated_attention.data` when none are given; documents are packed into
`--seq-len` rows that each start with BOS.

Gate parameters (names containing `attn_gate`) train at `--gate-lr`, the rest
at `--lr`: a converted model's gates start at weight 0 (score exactly 0.5),
and at a continued-pretraining learning rate they may barely move (official
repo issue #10). The log shows the mean gate score, so you can see whether they do.

Several processes on a CPU-only machine (a try-out; `--cpu --num_processes 2`
starts one process unless MPI is set up): `accelerate launch --multi_gpu
--num_processes 2 examples/continued_pretraining.py ...` (the script picks the
CPU and gloo itself).

Checkpoints (`--save-every`) are `accelerator.save_state` folders under
OUTPUT/checkpoints; `--resume latest` (or a checkpoint folder) continues at the
saved step with the same data order, because the batch of step s is a function
of (seed, s) only (see `gated_attention.training.StepBatches`); every line of
OUTPUT/log.jsonl has the step's batch digest. Run with the same number of
processes, batch size and accumulation to keep the order. The final model is
saved with `save_pretrained` in OUTPUT/final (with the remote-code bundle for
gated models) together with the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM

import gated_attention  # noqa: F401 - registers the gated model types with the Auto classes
from gated_attention.data import packed_rows, tokenizer_for
from gated_attention.training import (
    TrainConfig,
    evaluate_loss,
    latest_checkpoint,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    save_checkpoint,
    save_final,
    train,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser(description: str = __doc__.split("\n")[0], **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="causal LM folder or Hub id")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--text-files", nargs="*", help="training text files or folders (default: the embedded corpus)")
    p.add_argument("--valid-files", nargs="*", help="validation text (default: the embedded corpus's validation split)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed row, BOS included")
    p.add_argument("--batch-size", type=int, default=8, help="rows per process and micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in total")
    p.add_argument("--lr", type=float, default=2e-5, help="learning rate of all non-gate parameters")
    p.add_argument("--gate-lr", type=float, default=1e-3, help="learning rate of parameters named *attn_gate*")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", help="'latest' (in --output-dir) or a checkpoint folder")
    p.add_argument("--eval-sequences", type=int, default=32, help="validation rows evaluated at the end (0: none)")
    p.add_argument("--max-chars", type=int, help="use only a prefix of the embedded corpus (characters)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="weights' dtype (mixed precision comes from the accelerate config)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(**defaults)
    return p


def make_accelerator() -> Accelerator:
    """An Accelerator that uses the CPU (gloo) when the machine has no accelerator.

    Without `cpu=True`, processes started by `accelerate launch --multi_gpu` on a
    CPU-only machine would each train alone (DistributedType.NO), silently.
    """
    return Accelerator(cpu=not torch.accelerator.is_available())


def load_model(args):
    return AutoModelForCausalLM.from_pretrained(
        args.model, dtype=DTYPES[args.dtype], trust_remote_code=args.trust_remote_code
    )


def load_data(args, tokenizer, accelerator, seq_len: int | None = None):
    """(train rows, validation rows), each `[N, seq_len]`; the main process fills the corpus cache first."""
    seq_len = seq_len or args.seq_len
    with accelerator.main_process_first():
        train_rows = packed_rows(tokenizer, seq_len, text_files=args.text_files, split="train", max_chars=args.max_chars)
        valid_rows = None
        if args.eval_sequences:
            valid_rows = packed_rows(tokenizer, seq_len, text_files=args.valid_files, split="validation",
                                     max_chars=args.max_chars, max_rows=args.eval_sequences)
    return train_rows, valid_rows


def gate_parameter_count(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "attn_gate" in n and p.requires_grad)


def run_training(args, model, train_rows, accelerator, desc: str = "train"):
    """Prepare, optionally resume, train with checkpoints and a JSONL log. Returns the prepared model."""
    out = Path(args.output_dir)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        gate_lr=args.gate_lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, seed=args.seed,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20),
        log_every=args.log_every,
    )
    # The model is prepared before the optimizer is built, so that under FSDP the optimizer
    # holds the sharded parameters; the names (and with them the gate group) are kept.
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(make_optimizer(model, config.lr, config.gate_lr, config.weight_decay))
    # Not `prepare`d: accelerate would step it once per process per step. Registered so that
    # save_state / load_state carry it.
    scheduler = make_scheduler(optimizer, config.steps, config.warmup_steps)
    accelerator.register_for_checkpointing(scheduler)

    start = 0
    if args.resume:
        folder = latest_checkpoint(out) if args.resume == "latest" else Path(args.resume)
        if folder is None:
            accelerator.print(f"no checkpoint in {out}/checkpoints: starting at step 0")
        else:
            start = load_checkpoint(accelerator, folder)
            accelerator.print(f"resumed from {folder} at step {start}")

    log_path = out / "log.jsonl"

    def on_step(step: int, record: dict) -> None:
        if accelerator.is_main_process:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if step % args.log_every == 0 or step == config.steps:
                gate = "" if math.isnan(record["gate_score"]) else f"  gate {record['gate_score']:.4f}"
                print(f"step {step}/{config.steps}  loss {record['loss']:.4f}{gate}  lr {record['lr']:.3g}  "
                      f"gate_lr {record['gate_lr']:.3g}  batch {record['batch']}", flush=True)
        if (args.save_every and step % args.save_every == 0) or step == config.steps:
            save_checkpoint(accelerator, out, step)

    train(model, train_rows, config, optimizer, scheduler, accelerator=accelerator, start_step=start,
          on_step=on_step, desc=desc, progress=not args.no_progress)
    return model


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    accelerator = make_accelerator()
    set_seed(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)

    model = load_model(args)
    tokenizer = tokenizer_for(args.model, vocab_size=model.config.vocab_size,
                              trust_remote_code=args.trust_remote_code)
    train_rows, valid_rows = load_data(args, tokenizer, accelerator)
    accelerator.print(f"model {args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, "
                      f"{gate_parameter_count(model):,} in gates; {len(train_rows):,} training rows of {args.seq_len} "
                      f"tokens; {accelerator.num_processes} process(es)")

    model = run_training(args, model, train_rows, accelerator, desc="continued pretraining")

    if valid_rows is not None:
        loss = evaluate_loss(model, valid_rows, args.batch_size, accelerator)
        accelerator.print(f"validation: loss {loss:.4f}, perplexity {math.exp(loss):.3f} ({len(valid_rows)} rows)")
    save_final(accelerator, model, Path(args.output_dir) / "final", tokenizer)
    accelerator.print(f"saved {Path(args.output_dir) / 'final'}")
    accelerator.end_training()
    return model


if __name__ == "__main__":
    main()
