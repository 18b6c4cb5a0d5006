"""Longer context: RoPE-base change, continued training at a longer length, YaRN at evaluation.

    accelerate launch examples/long_context.py --model ./llama-gated --output-dir runs/long \
        --rope-theta 500000 --seq-len 8192 --steps 500 --eval-lengths 4096 8192 16384 32768 --yarn-factor 4

The recipe of the Gated Attention paper's context extension: raise the RoPE base
(`--rope-theta`), train further at the longer length (`--seq-len`), then
evaluate beyond it with YaRN (`--yarn-factor` over `--seq-len` positions; only
the evaluation and the extra checkpoint use it). The RoPE dicts come from
`gated_attention.convert.rope.apply_rope_change`, the same code as
`gated-attention convert/extend --rope-theta/--yarn-factor`.

Reported (printed and OUTPUT/perplexity_by_length.csv): validation perplexity
at each `--eval-lengths` length for the model before any change, after the
RoPE change and training, and the same with YaRN. OUTPUT/final is the trained
model (new base, no YaRN); for gated models OUTPUT/final-yarn is the same
weights with YaRN written by `extend_checkpoint`. Training options, data,
checkpoints and resume are those of `continued_pretraining.py`.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from transformers import AutoModelForCausalLM

from continued_pretraining import (
    DTYPES,
    build_parser,
    check_inputs,
    exit_on_input_error,
    load_data,
    load_model,
    load_tokenizer,
    make_accelerator,
    model_card,
    push_saved,
    run_training,
    set_threads,
)
from gated_attention.convert.rope import RopeChange, apply_rope_change
from gated_attention.cli_common import bounded
from gated_attention.hub.loading import from_pretrained_checked
from gated_attention.training.folders import output_folder
from gated_attention.training.data import packed_rows
from gated_attention.training import evaluate_loss, finish_training, reporting_interruption, save_final, with_rope


def perplexities(model, tokenizer, args, accelerator, lengths: list[int], yarn_params=None) -> dict[int, float]:
    """Validation perplexity at each length (`yarn_params`: (rope_parameters, max_positions) to evaluate with)."""
    if yarn_params is not None:
        model = with_rope(model, *yarn_params)
    out = {}
    for length in lengths:
        rows = packed_rows(tokenizer, length, text_files=args.valid_files, split="validation",
                           max_chars=args.max_chars, max_rows=args.eval_sequences)
        out[length] = math.exp(evaluate_loss(model, rows, args.batch_size, accelerator)) if len(rows) else float("nan")
    return out


@exit_on_input_error
def main(argv: list[str] | None = None):
    parser = build_parser(__doc__.split("\n")[0], seq_len=2048, steps=500)
    parser.add_argument("--rope-theta", type=bounded(float, 0, strict=True), required=True, help="new RoPE base")
    parser.add_argument("--eval-lengths", type=bounded(int, 2), nargs="+", help="default: --seq-len x 1, 2, 4")
    parser.add_argument("--yarn-factor", type=bounded(float, 1, strict=True),
                        help="YaRN factor over --seq-len (default: longest eval length / --seq-len)")
    args = parser.parse_args(argv)
    if not args.eval_sequences:
        parser.error("--eval-sequences must be at least 1: the example reports perplexity by length")
    lengths = args.eval_lengths or [args.seq_len, 2 * args.seq_len, 4 * args.seq_len]
    yarn_factor = args.yarn_factor or max(lengths) / args.seq_len
    if yarn_factor <= 1:
        parser.error("no --eval-lengths is longer than --seq-len, so there is no YaRN factor above 1: give --yarn-factor")
    with reporting_interruption(args.output_dir):
        return long_context(args, lengths, yarn_factor)


def long_context(args, lengths: list[int], yarn_factor: float) -> list[dict]:
    """The run, once the flags are parsed (`main` adds what Ctrl-C prints)."""
    # Training beyond the model's positions is the point here: the RoPE base change comes first.
    config = check_inputs(args, rope_change=True)
    accelerator = make_accelerator()
    set_threads(args, accelerator)
    tokenizer = load_tokenizer(args, config)
    train_rows, _ = load_data(args, tokenizer, accelerator)
    device = accelerator.device
    before = perplexities(load_model(args).to(device), tokenizer, args, accelerator, lengths)

    # 1. RoPE base change: new rotary tables, same weights.
    rope_parameters, _ = apply_rope_change(config.rope_parameters, config.max_position_embeddings,
                                           RopeChange(rope_theta=args.rope_theta))
    max_positions = max(config.max_position_embeddings, args.seq_len)
    model = load_model(args, rope_parameters=rope_parameters, max_position_embeddings=max_positions)
    accelerator.print(f"RoPE base {config.rope_parameters.get('rope_theta')} -> {args.rope_theta:g}; "
                      f"training at {args.seq_len} tokens (was {config.max_position_embeddings})")

    with output_folder(args.output_dir) as out:
        rows = train_and_evaluate(args, model, train_rows, tokenizer, accelerator, out, lengths, yarn_factor, before)
    main_process = accelerator.is_main_process
    finish_training(accelerator)  # the training wrapper lives only in accelerate's own lists by now
    if main_process:
        push_saved(args, out / "final", "long_context.py")
    return rows


def train_and_evaluate(args, model, train_rows, tokenizer, accelerator, out: Path, lengths: list[int],
                       yarn_factor: float, before: dict[int, float]) -> list[dict]:
    """Steps 2 and 3: train at the longer length, save, and measure perplexity by length without and with YaRN."""
    device = accelerator.device
    # 2. Continued training at the longer length.
    model = run_training(args, model, train_rows, accelerator, desc=f"train @{args.seq_len}")
    save_final(accelerator, model, out / "final", tokenizer, step=args.steps, card=model_card(
        args, "long_context.py", f"{args.model} with RoPE base {args.rope_theta:g}, trained at {args.seq_len} tokens.",
        **{"--rope-theta": args.rope_theta}))

    # 3. Evaluation by length, without and with YaRN over the new training length.
    trained = from_pretrained_checked(AutoModelForCausalLM, out / "final", dtype=DTYPES[args.dtype],
                                      trust_remote_code=args.trust_remote_code).to(device)
    after = perplexities(trained, tokenizer, args, accelerator, lengths)
    yarn = apply_rope_change(trained.config.rope_parameters, args.seq_len,
                             RopeChange(yarn_factor=yarn_factor, original_max_position_embeddings=args.seq_len))
    with_yarn = perplexities(trained, tokenizer, args, accelerator, lengths, yarn_params=yarn)

    rows = [{"length": n, "before": before[n], "rope_base_trained": after[n], "rope_base_trained_yarn": with_yarn[n]}
            for n in lengths]
    if accelerator.is_main_process:
        with open(out / "perplexity_by_length.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nvalidation perplexity by length (trained at {args.seq_len}; YaRN factor {yarn_factor:g})")
        print(f"{'length':>8}  {'before':>10}  {'base ' + format(args.rope_theta, 'g'):>12}  {'+ YaRN':>10}")
        for r in rows:
            print(f"{r['length']:>8}  {r['before']:>10.3f}  {r['rope_base_trained']:>12.3f}  {r['rope_base_trained_yarn']:>10.3f}")
        if trained.config.model_type in ("gated_attention", "gated_attention_moe", "gated_deltanet_hybrid"):
            from gated_attention.convert.convert import extend_checkpoint

            change = RopeChange(yarn_factor=yarn_factor, original_max_position_embeddings=args.seq_len)
            extend_checkpoint(str(out / "final"), out / "final-yarn", rope=change, overwrite=True)
    return rows


if __name__ == "__main__":
    main()
