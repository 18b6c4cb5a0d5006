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

QLoRA (`--load-in-4bit`, needs bitsandbytes: `pip install "gated-attention[quant]"`):
the base's Linear layers are loaded in 4-bit NF4 (bitsandbytes' `Linear4bit`,
computed in `--dtype`), except the gates and `lm_head` (`llm_int8_skip_modules`).
peft's `prepare_model_for_kbit_training` casts the layers left unquantized
(gates, embeddings, norms, `lm_head`) to float32 whatever `--dtype` is, so the
gates train in float32, and the LoRA adapters learn against the 4-bit base. A
4-bit base cannot take the merge exactly (the sum would be rounded to 4 bits
again), so the merged model is `--model` reloaded in `--dtype` with the trained
adapters and gates applied and merged: the full-precision base plus adapters
trained against its 4-bit copy. Its logits differ from those of the 4-bit
model that was trained by the base's quantization error; the run prints the
largest difference on two rows next to the reload check. A 4-bit run cannot be
resumed (`--resume` is refused: bitsandbytes' 4-bit layers cannot load the
state they save).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, prepare_model_for_kbit_training
from peft import set_peft_model_state_dict
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from transformers.utils import is_bitsandbytes_available

from continued_pretraining import (
    DTYPES,
    InputError,
    build_parser,
    check_inputs,
    exit_on_input_error,
    gate_parameter_count,
    load_data,
    load_model,
    load_tokenizer,
    make_accelerator,
    model_card,
    push_saved,
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


def four_bit_config(args) -> BitsAndBytesConfig:
    """NF4 (QLoRA's 4-bit type, scales quantized too) for every Linear layer but the gates and the LM head,
    computed in `--dtype`; `InputError` without bitsandbytes or with `--resume`."""
    if not is_bitsandbytes_available():  # transformers' own test, with its minimum version
        raise InputError('--load-in-4bit needs bitsandbytes, which is missing or too old here: '
                         'pip install "gated-attention[quant]"')
    if args.resume:  # loading would fail only after the model is loaded, with a list of unexpected keys
        raise InputError("--resume with --load-in-4bit: bitsandbytes' 4-bit layers cannot load the state they save "
                         "(bitsandbytes issue #1946), so a 4-bit run cannot be resumed from its checkpoints")
    # transformers matches a plain name here only as a prefix or a suffix of a module's path: "attn_gate" would
    # leave the Linear layers inside a low-rank gate (attn_gate.down, attn_gate.up) to be quantized.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=DTYPES[args.dtype],
                              llm_int8_skip_modules=[r".*\.attn_gate", "lm_head"])


def load_base(args, quantization: BitsAndBytesConfig | None):
    """`--model` for LoRA: in `--dtype`, or quantized (`four_bit_config`).

    A quantized base goes through peft's `prepare_model_for_kbit_training`, which casts the layers left
    unquantized (embeddings, norms, gates, LM head) to float32 whatever `--dtype` is: the gates train in float32.
    """
    if quantization is None:
        return load_model(args)
    # Without gradient checkpointing, which peft turns on by default: it trades compute for activation
    # memory, not weight memory, and the full-precision runs of these examples do not checkpoint either.
    return prepare_model_for_kbit_training(load_model(args, quantization_config=quantization),
                                           use_gradient_checkpointing=False)


def onto_full_precision(trained, args):
    """The adapters and gates of `trained` (a PEFT model on a 4-bit base) on `--model` reloaded in `--dtype`.

    On the CPU, where `load_model` puts it: beside the 4-bit model an accelerator may have no room for it.
    """
    model = get_peft_model(load_model(args), trained.peft_config["default"])
    result = set_peft_model_state_dict(model, get_peft_model_state_dict(trained))
    left = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k] + result.unexpected_keys
    if left:
        raise RuntimeError(f"the adapter trained on the 4-bit base does not fit {args.model} in {args.dtype}: {left[0]}")
    return model


@torch.no_grad()
def max_logits_difference(a, b, input_ids: torch.Tensor) -> float:
    """Max |logits difference| between models `a` and `b` on `input_ids` `[B, T]`, each on its own device."""
    x = a.eval()(input_ids=input_ids.to(a.device)).logits
    y = b.eval()(input_ids=input_ids.to(b.device)).logits.to(x.device)
    return (x.float() - y.float()).abs().max().item()


def check_reload(model, folder: Path, input_ids: torch.Tensor, trust_remote_code: bool = True) -> float:
    """Max |logits difference| between `model` and the copy saved in `folder`, reloaded."""
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype, trust_remote_code=trust_remote_code)
    return max_logits_difference(model, reloaded, input_ids)


@exit_on_input_error
def main(argv: list[str] | None = None):
    parser = build_parser(__doc__.split("\n")[0], lr=2e-4, steps=500)
    parser.add_argument("--rank", type=bounded(int, 1), default=16)
    parser.add_argument("--alpha", type=bounded(float, 0, strict=True), default=32)
    parser.add_argument("--lora-dropout", type=bounded(float, 0, high=1), default=0.0)
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: the base in 4-bit NF4 (bitsandbytes) but for the gates and lm_head; merged onto "
                             "the base reloaded in --dtype")
    args = parser.parse_args(argv)
    with reporting_interruption(args.output_dir):
        return lora_finetune(args)


def lora_finetune(args):
    """The run, once the flags are parsed (`main` adds what Ctrl-C prints)."""
    config = check_inputs(args)
    quantization = four_bit_config(args) if args.load_in_4bit else None
    accelerator = make_accelerator()
    set_threads(args, accelerator)
    tokenizer = load_tokenizer(args, config)
    train_rows, valid_rows = load_data(args, tokenizer, accelerator)
    base = load_base(args, quantization)
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
        trained = accelerator.unwrap_model(model)
        merged = (onto_full_precision(trained, args) if args.load_in_4bit else trained).merge_and_unload()
        check_finite_weights(merged, accelerator, step=args.steps, saving="merged/")
        if accelerator.is_main_process:
            # renamed to merged/ when whole; a full disk is one line
            with full_disk_is_one_line(out, "saving merged/"), staged_output(out / "merged") as stage:
                merged.save_pretrained(stage)
                tokenizer.save_pretrained(stage)
                # Merged onto the base: a full model, so the Hub's relation is finetune (an adapter repo holds
                # only the LoRA weights, and needs the base to run).
                model_card(args, "lora_finetune.py", f"{args.model} fine-tuned with LoRA (rank {args.rank}, the "
                           "gates trained in full), the LoRA weights merged into the base.", rank=args.rank,
                           alpha=args.alpha)(stage)
            if valid_rows is not None:
                probe = valid_rows[:2]
            else:  # a stream has no rows to slice: the next two will do
                probe = train_rows.next_rows(2) if hasattr(train_rows, "next_rows") else train_rows[:2]
            diff = check_reload(merged, out / "merged", probe)
            print(f"saved {out / 'merged'}; reloaded with trust_remote_code: max |logits difference| {diff:g}")
            if diff != 0:
                raise RuntimeError(f"the reloaded merged model's logits differ from the merged model's (max {diff:g})")
            if args.load_in_4bit:
                print(f"merged onto {args.model} in {args.dtype}: max |logits difference| from the 4-bit model as "
                      f"trained {max_logits_difference(trained, merged, probe):g} (the base's quantization error)")
    del model  # the DDP/FSDP wrapper goes before the process group (finish_training)
    main_process = accelerator.is_main_process
    finish_training(accelerator)
    if main_process:  # merged/ is whole and reloads with the merged model's logits by now
        push_saved(args, out / "merged", "lora_finetune.py")
    return merged


if __name__ == "__main__":
    main()
