"""`gated-attention quantize MODEL DST --scheme SCHEME [--gates keep|quantize]`: a compressed-tensors checkpoint.

Building the parser imports no torch; `run` imports `quantize` when the command runs.
"""

from __future__ import annotations

from ..cli_common import add_command, add_push_to_hub, add_revision, bounded, existing_file

GATES = ("keep", "quantize")


def register(subparsers) -> None:
    summary = "write a compressed-tensors checkpoint of a model (W8A8, W4A16, FP8, NVFP4, ...), gates kept or rounded"
    p = add_command(subparsers, "quantize", run, summary, """
        Round MODEL's linear maps (all but lm_head; not the embeddings) to compressed-tensors' preset SCHEME, to
        nearest with min-max scales (static activation scales from the calibration inputs), and write the
        compressed checkpoint to DST with MODEL's tokenizer, its remote code and a model card. Before DST
        appears, the written checkpoint is loaded back by transformers and compared with the measurement of the
        same scheme and arm that `analyze --quantization` makes: DST appears whole or not at all.
    """)
    p.add_argument("model", metavar="MODEL", help="model folder or Hugging Face Hub id (from the local cache)")
    p.add_argument("dst", metavar="DST", help="output folder, created whole at the end")
    p.add_argument("--scheme", required=True, metavar="SCHEME",
                   help="compressed-tensors' preset scheme: W8A8, W4A16, FP8, FP8_DYNAMIC, NVFP4, MXFP4, ... (any case)")
    p.add_argument("--gates", choices=GATES,
                   help="keep every gate module (a gate fused into q_proj: that whole q_proj, with k_proj and v_proj) in full precision, or "
                   "round it as the rest (default: keep where the model has a gate; docs/quantization.md has the "
                   "measurements); keep on a model without a gate is refused")
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--text-file", metavar="PATH", type=existing_file,
                        help="calibration and verification inputs: UTF-8 text, one input per blank-line-separated "
                        "paragraph (default: the built-in prose, code and math samples)")
    inputs.add_argument("--dataset", nargs="+", metavar="SPEC",
                        help="calibration and verification inputs from a dataset, as `analyze --dataset` takes it")
    p.add_argument("--text-field", default="text", metavar="NAME", help="the text column of --dataset (default: text)")
    p.add_argument("--n-per-domain", type=bounded(int, 1), default=4, metavar="N",
                   help="built-in samples per domain, or documents of --dataset (default: %(default)s)")
    p.add_argument("--max-length", type=bounded(int, 2), default=128, metavar="T",
                   help="tokens per input, at most (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST checkpoint")
    add_revision(p, "MODEL")
    add_push_to_hub(p)


def run(args) -> int:
    from .. import CLIError
    from ..hub.push import PushFailed, push_folder, push_problem

    if problem := push_problem(args):
        raise CLIError(problem)
    from .quantize import quantize_checkpoint

    dst = quantize_checkpoint(args)
    if args.push_to_hub:  # DST is in place, loaded back and compared with the measurement by now
        try:
            url = push_folder(dst, args.push_to_hub, private=args.private,
                              command=f"gated-attention quantize {args.model}")
        except PushFailed as e:
            raise CLIError(str(e)) from None
        print(f"pushed {dst} to {url}")
    return 0
