"""LoRA fine-tuning of a gated model with PEFT, then merge and save; `accelerate launch` or plain python.

    accelerate launch examples/lora_finetune.py --model ./llama-gated --output-dir runs/lora \
        --text-files data/ --seq-len 1024 --steps 500 --lr 2e-4 --gate-lr 1e-3 --rank 16

LoRA adapters go on the attention projections (q/k/v/o_proj) and the MLP
projections (gate/up/down_proj). The gate modules are trained in full
(`modules_to_save=["attn_gate"]`): a converted model's gates start at weight 0,
and a low-rank update of a zero matrix is a poor way to learn them. (This is
why the gate is named `attn_gate`: PEFT matches module names by suffix, so a
gate called `gate` or `gate_proj` would be confused with the MLP.)

After training, the adapters are merged (`merge_and_unload`), the merged model
is saved with its remote-code bundle in OUTPUT/merged, reloaded from there with
`trust_remote_code=True`, and its logits are compared with the in-memory
merged model's. Training options, data, checkpoints and resume are those of
`continued_pretraining.py`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from continued_pretraining import (
    build_parser,
    check_inputs,
    exit_on_input_error,
    gate_parameter_count,
    load_data,
    load_model,
    load_tokenizer,
    make_accelerator,
    run_training,
    set_threads,
)
from gated_attention.cli_common import bounded
from gated_attention.training.folders import full_disk_is_one_line, output_folder, staged_output
from gated_attention.training import check_finite_weights, evaluate_loss, finish_training, reporting_interruption

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(args, model) -> LoraConfig:
    has_gates = any(name.endswith("attn_gate") for name, _ in model.named_modules())
    return LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.lora_dropout,
        target_modules=LORA_TARGETS,
        modules_to_save=["attn_gate"] if has_gates else None,
        task_type="CAUSAL_LM",
    )


@torch.no_grad()
def check_reload(model, folder: Path, input_ids: torch.Tensor, trust_remote_code: bool = True) -> float:
    """Max |logits difference| between `model` and the copy saved in `folder`, reloaded."""
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype, trust_remote_code=trust_remote_code)
    a = model.eval()(input_ids=input_ids).logits
    b = reloaded.eval()(input_ids=input_ids.to(reloaded.device)).logits.to(a.device)
    return (a.float() - b.float()).abs().max().item()


@exit_on_input_error
def main(argv: list[str] | None = None):
    parser = build_parser(__doc__.split("\n")[0], lr=2e-4, steps=500)
    parser.add_argument("--rank", type=bounded(int, 1), default=16)
    parser.add_argument("--alpha", type=bounded(float, 0, strict=True), default=32)
    parser.add_argument("--lora-dropout", type=bounded(float, 0, high=1), default=0.0)
    args = parser.parse_args(argv)
    with reporting_interruption(args.output_dir):
        return lora_finetune(args)


def lora_finetune(args):
    """The run, once the flags are parsed (`main` adds what Ctrl-C prints)."""
    config = check_inputs(args)
    accelerator = make_accelerator()
    set_threads(args, accelerator)
    tokenizer = load_tokenizer(args, config)
    train_rows, valid_rows = load_data(args, tokenizer, accelerator)
    base = load_model(args)
    model = get_peft_model(base, lora_config(args, base))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(f"LoRA rank {args.rank} on {', '.join(LORA_TARGETS)}; trainable {trainable:,} parameters, "
                      f"{gate_parameter_count(model):,} of them in gates (trained in full)")

    with output_folder(args.output_dir) as out:
        model = run_training(args, model, train_rows, accelerator, desc="LoRA")
        if valid_rows is not None:
            loss = evaluate_loss(model, valid_rows, args.batch_size, accelerator)
            accelerator.print(f"validation: loss {loss:.4f}, perplexity {math.exp(loss):.3f} ({len(valid_rows)} rows)")
        accelerator.wait_for_everyone()
        merged = accelerator.unwrap_model(model).merge_and_unload()
        check_finite_weights(merged, accelerator, step=args.steps, saving="merged/")
        if accelerator.is_main_process:
            # renamed to merged/ when whole; a full disk is one line
            with full_disk_is_one_line(out, "saving merged/"), staged_output(out / "merged") as stage:
                merged.save_pretrained(stage)
                tokenizer.save_pretrained(stage)
            if valid_rows is not None:
                probe = valid_rows[:2]
            else:  # a stream has no rows to slice: the next two will do
                probe = train_rows.next_rows(2) if hasattr(train_rows, "next_rows") else train_rows[:2]
            diff = check_reload(merged, out / "merged", probe.to(next(merged.parameters()).device))
            print(f"saved {out / 'merged'}; reloaded with trust_remote_code: max |logits difference| {diff:g}")
            if diff != 0:
                raise RuntimeError(f"the reloaded merged model's logits differ from the merged model's (max {diff:g})")
    del model  # the DDP/FSDP wrapper goes before the process group (finish_training)
    finish_training(accelerator)
    return merged


if __name__ == "__main__":
    main()
