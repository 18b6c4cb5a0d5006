"""`gated-attention analyze MODEL --out DIR`: sink, activation, gate and spike/plateau metrics."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16", "auto")
# `interventions.KINDS`, written out so that building the parser imports no torch (tests/test_cli.py checks they agree)
INTERVENTIONS = ("deletion", "connection")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="attention-sink, massive-activation, gate and spike/plateau metrics of a causal LM",
        description=(
            "Capture the residual stream, attention maps (eager attention) and gate scores of MODEL on "
            "built-in prose/code/math samples (or --text-file), and write arrays.npz, tidy CSV tables, "
            "PNG plots and summary.md to DIR. Metric definitions: README.md, 'analyze', and gated_attention/analysis/metrics.py."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="local model folder or Hugging Face Hub id")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--text-file", metavar="PATH", help="UTF-8 text; one input per blank-line-separated paragraph")
    p.add_argument("--n-per-domain", type=int, default=4, help="built-in samples per domain (prose, code, math)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per input (longer inputs are truncated)")
    p.add_argument("--tokenizer", metavar="PATH_OR_ID", help="tokenizer to use (default: MODEL's)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with the checkpoint")
    p.add_argument("--intervene", choices=INTERVENTIONS, help="also report perplexity/accuracy with this intervention")
    p.add_argument("--k", type=int, choices=(1, 2, 4), default=1, help="coordinates per attention input for --intervene")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the confidence intervals")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.set_defaults(func=run)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that does not exist is a missing folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _load(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import register_auto_classes
    from .. import CLIError

    register_auto_classes()  # MODEL may be one of ours, loaded without remote code

    if not Path(args.model).expanduser().exists() and _looks_like_path(args.model):
        raise CLIError(f"model folder not found: {args.model}")
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(Path(args.model).expanduser()) if Path(args.model).expanduser().exists() else args.model,
            dtype=dtype,
            trust_remote_code=args.trust_remote_code,
        )
    except Exception as e:  # noqa: BLE001 - any loading failure is one line for the user
        raise CLIError(f"cannot load model {args.model!r}: {_first_line(e)}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot load a tokenizer from {args.tokenizer or args.model!r} (pass --tokenizer): {_first_line(e)}") from e
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = model.to(device).eval()
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot move the model to {device!r}: {_first_line(e)}") from e
    return model, tokenizer


def run(args) -> int:
    from .. import CLIError
    from .analyze import run_analysis
    from .samples import builtin_samples, read_text_file

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out exists and is not a folder: {out}")
    if args.n_per_domain < 1 or args.max_length < 2:
        raise CLIError("--n-per-domain must be >= 1 and --max-length >= 2")
    if args.text_file:
        try:
            samples = read_text_file(args.text_file)
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --text-file: {_first_line(e)}") from e
        if not samples:
            raise CLIError(f"--text-file {args.text_file} holds no text")
    else:
        samples = builtin_samples(args.n_per_domain)

    model, tokenizer = _load(args)
    try:
        rows = run_analysis(
            model,
            tokenizer,
            samples,
            out,
            model_name=args.model,
            max_length=args.max_length,
            intervention=args.intervene,
            k=args.k,
            n_bootstrap=args.bootstrap,
            seed=args.seed,
        )
    except ValueError as e:
        raise CLIError(_first_line(e)) from e
    for row in rows:
        if row["metric"] in ("f_attn", "m_act", "gate_mean", "sink_spike_alignment", "inter_spike_retention"):
            value = "undefined" if math.isnan(row["mean"]) else f"{row['mean']:.4g}"
            print(f"{row['metric']:<24} {row['anchor']:<15} {value}")
    print(f"wrote {out / 'summary.md'}")
    return 0
