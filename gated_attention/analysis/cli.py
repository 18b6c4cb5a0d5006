"""`gated-attention analyze MODEL [MODEL ...] --out DIR`: sink, activation, gate and spike/plateau metrics.

Option values, paths and each MODEL's whereabouts are checked before torch is imported, with the checks
`stream` shares (`command_checks`: a Hub id is looked up with one request first, `resolve`).

DIR appears whole or not at all: everything is written into a staging folder beside it
(`files.staging`) and renamed into place at the end, replacing an earlier analysis at DIR whole, never
merging into it. A failure, Ctrl-C or a model whose attention cannot be captured leaves DIR as it was.
Several MODELs are analysed one after the other into DIR/<name>/, with a comparison drawn from their
files (`compare.py`).
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

from .. import CLIError
from ..cli_common import DEVICE, add_command, add_revision, bounded, device_name, existing_file, first_line, memory_size
from .command_checks import check_config, check_names, check_out, out_dir, resolve, staged_output
from .loading import DEVICE_MAPS

DTYPES = ("float32", "bfloat16", "float16", "auto")
# `interventions.KINDS`, written out so that building the parser imports no torch (tests/test_cli.py checks they agree)
INTERVENTIONS = ("deletion", "set-mean", "connection")
# A --dataset text is read up to this many characters per token of --max-length: more than any token covers
# (BPE and SentencePiece tokens run to tens of characters), so the first T tokens are those of the whole text,
# and a document of one 200 MB line costs what its first characters cost.
CHARS_PER_TOKEN = 1024


def _device_map(text: str) -> str:
    if text in DEVICE_MAPS or (DEVICE.match(text) and text != "auto"):
        return text
    raise argparse.ArgumentTypeError(f"expected {', '.join(DEVICE_MAPS)} or one device (cpu, cuda:N, ...), got {text!r}")


def _epsilon(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (exclusive), got {text!r}")
    return value


def register(subparsers) -> None:
    summary = "attention-sink, massive-activation, gate and spike/plateau metrics of causal LMs"
    p = add_command(subparsers, "analyze", run, summary, """
        Capture the residual stream, attention maps (eager attention) and gate scores of MODEL on built-in
        prose/code/math samples (or --text-file, or --dataset), and write arrays.npz, tidy CSV tables, PNG plots
        and summary.md to DIR. With several MODELs, each goes to DIR/<name>/ and comparison.csv / comparison.png
        draw them side by side. DIR is written beside itself and renamed into place when complete: an earlier
        analysis at DIR is replaced whole, a folder holding anything else is refused, and a second run into the
        same DIR while one runs is refused. Metric definitions: README.md, 'Analyze', and
        gated_attention/analysis/metrics.py.
    """)
    p.add_argument("model", metavar="MODEL", nargs="+", help="local model folder, Hugging Face Hub id, or .gguf file (dequantized "
                   "by transformers' GGUF loader); one or more")
    add_revision(p, "MODEL")
    p.add_argument("--out", required=True, metavar="DIR", type=out_dir,
                   help="output folder, created whole at the end; an earlier analysis there is replaced")
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--text-file", metavar="PATH", type=existing_file,
                        help="UTF-8 text, one input per blank-line-separated paragraph (default: the built-in samples)")
    inputs.add_argument("--dataset", nargs="+", action="append", metavar="SPEC",
                        help="a dataset as the training examples take it: jsonl/json, parquet, csv or txt files of one "
                        "kind, a folder of them, a save_to_disk folder or a Hub dataset id from the local cache; repeat "
                        "the flag for several datasets, each a domain of its own unless --domain-field is given")
    p.add_argument("--text-field", action="append", metavar="NAME",
                   help="the text column of --dataset: once for all, or once per --dataset in order (default: text)")
    p.add_argument("--domain-field", metavar="NAME",
                   help="a --dataset column whose values are the domains to take --n-per-domain inputs from "
                   "(each dataset is then read to its end)")
    p.add_argument("--split", help="split of a --dataset folder, saved dataset or Hub id (default: train; a dataset "
                   "saved alone: itself)")
    p.add_argument("--n-per-domain", type=bounded(int, 1), default=4, metavar="N",
                   help="inputs per domain: built-in samples per prose, code and math, or the first N documents "
                   "with text of each --dataset domain (default: %(default)s)")
    p.add_argument("--max-length", type=bounded(int, 2), default=128, metavar="T",
                   help="tokens per input, at most: longer inputs are cut to T tokens, or to the model's "
                   "max_position_embeddings where that is smaller, with a warning (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="PATH_OR_ID", help="tokenizer folder or Hub id (default: each MODEL's)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", type=device_name, default="auto",
                       help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, ... (default: %(default)s); cpu and "
                       "cuda place the model with accelerate within --max-memory, cuda:N puts it whole on that GPU")
    where.add_argument("--device-map", type=_device_map, metavar="MAP",
                       help="accelerate's device map: auto (the GPUs in order, then the CPU within --max-memory, then "
                       "disk), balanced, balanced_low_0, sequential, or one device (cpu, cuda:N)")
    p.add_argument("--max-memory", type=memory_size, metavar="SIZE",
                   help="the most CPU memory the whole process may hold, Python, torch and the libraries included, "
                   "e.g. 4GB or 512MiB: what it holds before the model loads and a reserve for running it (more for "
                   "a longer --max-length) come off, the model's weights get the rest, and the layers that do not fit "
                   "are read from the checkpoint's files as they run; the split is printed once, at the start, before "
                   "the model loads (default: what is free when the run starts)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with the checkpoint")
    p.add_argument("--intervene", choices=INTERVENTIONS,
                   help="also report perplexity and next-token accuracy with the --k largest coordinates of the first "
                   "token's residual state at every attention layer's input (or where --intervene-layers and "
                   "--intervene-tokens say) set to 0 (deletion), set to their mean over the inputs (set-mean), "
                   "or held at their spike's magnitude up to the next attention layer (connection); pinning those "
                   "coordinates to their own values must give the normal logits bit for bit (the identity check, in "
                   "summary.md)")
    p.add_argument("--k", type=int, choices=(1, 2, 4), default=1,
                   help="coordinates per edited state for --intervene, chosen on each input (default: %(default)s)")
    p.add_argument("--intervene-layers", type=bounded(int, 0), nargs="+", metavar="L",
                   help="deletion and set-mean at the residual states X[L] instead: X[0] is the embedding output, "
                   "X[L] the output of decoder layer L (counted from 1; transformers' layer_idx L-1), which is the "
                   "input of layer L+1 (default: the inputs of the attention layers, X[f-1] for each attention layer f)")
    p.add_argument("--intervene-tokens", type=bounded(int, 0), nargs="+", metavar="T",
                   help="--intervene on these token positions (0-based, each below the shortest input's length) "
                   "instead of the first token; set-mean takes each token's own mean over the inputs (default: 0)")
    p.add_argument("--quantization", nargs="+", metavar="SCHEME",
                   help="also measure what each compressed-tensors preset scheme (W8A8, W4A16, FP8, NVFP4, MXFP4, ...; "
                   "any case) costs the model on the same inputs, rounded to nearest with min-max scales: every linear "
                   "map but lm_head (arm all), all but the gates (gates_kept), the gates alone (gates_only), and a "
                   "gate fused into q_proj's rows apart from the query's (gate_rows_only, query_rows_only); perplexity, "
                   "KL from the unquantized model and top-1 agreement go to quantization.csv, the outlier statistics "
                   "of each attention output projection's, MLP down projection's and gate's input to "
                   "quantization_layers.csv (needs compressed-tensors: pip install \"gated-attention[quant]\")")
    p.add_argument("--sink-epsilon", type=_epsilon, default=0.3, metavar="EPS",
                   help="the sink rate's threshold (Gu et al. 2024): a head is a sink head where its mean attention on "
                   "the first token, over all queries, exceeds EPS; layers.csv and summary.md give the fraction of "
                   "such heads (default: %(default)s)")
    p.add_argument("--bootstrap", type=bounded(int, 1), default=1000, metavar="N",
                   help="bootstrap resamples for the confidence intervals (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")


def _check_inputs(args) -> None:
    """--text-field and --domain-field make sense only with --dataset; --text-field once or once per dataset."""
    fields = args.text_field or []
    if (fields or args.domain_field) and not args.dataset:
        raise CLIError(f"{'--text-field' if fields else '--domain-field'} is for --dataset, which is not given")
    if args.dataset and len(fields) not in (0, 1, len(args.dataset)):
        raise CLIError(f"--text-field is given {len(fields)} times for {len(args.dataset)} --dataset: give it once, or once per --dataset")


def _check_quantization(args) -> None:
    """--quantization: compressed-tensors' preset names (which needs compressed-tensors installed)."""
    if not args.quantization:
        return
    from ..quantization.schemes import QuantizationError, canonical

    try:
        args.quantization = list(dict.fromkeys(canonical(name) for name in args.quantization))
    except QuantizationError as e:
        raise CLIError(f"--quantization: {e}") from None


def _check_intervention(args) -> None:
    """--intervene-layers and --intervene-tokens qualify --intervene; connection acts between attention layers only."""
    for flag, value in (("--intervene-layers", args.intervene_layers), ("--intervene-tokens", args.intervene_tokens)):
        if value and not args.intervene:
            raise CLIError(f"{flag} is for --intervene, which is not given")
    if args.intervene_layers and args.intervene == "connection":
        raise CLIError("--intervene-layers is for deletion and set-mean: connection holds the spike from each "
                       "attention layer's input to the next")


# What an earlier analysis leaves in DIR: a folder holding one of them may be replaced whole.
ANALYSIS_FILES = ("arrays.npz", "summary.md", "comparison.csv")


# The files the comparison writes beside the model folders (`compare.FILES`), written out so that the parser imports
# no matplotlib (tests/test_analyze_cli.py checks they agree)
COMPARISON_FILES = ("comparison.csv", "comparison.png", "summary.md", "quantization.csv")


def output_names(models: list[str]) -> list[str]:
    """One folder name per MODEL: its folder's name or its Hub id with '/' as '--', numbered where two agree or
    where it is the name of a comparison file."""
    names = []
    for model in models:
        path = Path(model).expanduser()
        base = path.resolve().name if path.exists() else model.strip("/").replace("/", "--")
        base = base or "model"
        name, n = base, 2
        while name in names or name in COMPARISON_FILES:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def _samples(args):
    from ..files.datasets import DataError
    from .samples import DatasetSpec, builtin_samples, dataset_samples, read_text_file

    if args.text_file:
        try:
            samples = read_text_file(args.text_file)
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --text-file: {first_line(e)}") from e
        if not samples:
            raise CLIError(f"--text-file {args.text_file} holds no text")
        return samples
    if not args.dataset:
        return builtin_samples(args.n_per_domain)
    fields = args.text_field or ["text"]
    datasets = [DatasetSpec(tuple(spec), fields[i] if len(fields) > 1 else fields[0]) for i, spec in enumerate(args.dataset)]
    from tqdm.auto import tqdm

    with warnings.catch_warnings(record=True) as said, tqdm(desc="reading --dataset", unit="doc") as bar:
        try:
            samples = dataset_samples(datasets, args.n_per_domain, domain_field=args.domain_field,
                                      split=args.split, max_chars=args.max_length * CHARS_PER_TOKEN,
                                      progress=bar.update)
        except DataError as e:
            raise CLIError(str(e)) from None
    for w in said:  # after the bar, which holds the line while it runs
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return samples


def _print_rows(label: str, rows: list[dict]) -> None:
    for row in rows:
        if row["metric"] in ("f_attn", "sink_rate", "m_act", "gate_mean", "sink_spike_alignment", "inter_spike_retention"):
            value = "undefined" if math.isnan(row["mean"]) else f"{row['mean']:.4g}"
            print(f"{label}{row['metric']:<24} {row['anchor']:<15} {value}")


def run(args) -> int:
    import weakref

    check_names(args.model, args.tokenizer, args.revision)
    _check_inputs(args)
    _check_intervention(args)
    _check_quantization(args)
    check_out(args.out, args.model, args.tokenizer, what="the output of an earlier analyze (arrays.npz, summary.md)",
              ours=ANALYSIS_FILES)
    where = {name: resolve(name, args.revision if name in args.model else None) for name in dict.fromkeys([*args.model, *([args.tokenizer] if args.tokenizer else [])])}
    for model in args.model:
        check_config(model, where[model])
    samples = _samples(args)

    from ..memory.budget import MemoryBudget, collect_if_alive
    from .analyze import run_analysis
    from .loading import LoadOptions, check_device, loaded
    from .compare import write_comparison

    out = Path(args.out).expanduser()
    several = len(args.model) > 1
    names = output_names(args.model)
    options = LoadOptions.from_args(args)
    budget = MemoryBudget.resolve(args.max_memory)  # measured once: every model gets the same
    check_device(options)
    with staged_output(out) as stage:
        for model_name, name in zip(args.model, names):
            with loaded(options, model_name, where, budget, stage) as (model, tokenizer):
                try:
                    rows = run_analysis(
                        model,
                        tokenizer,
                        samples,
                        stage / name if several else stage,
                        model_name=model_name,
                        max_length=args.max_length,
                        intervention=args.intervene,
                        k=args.k,
                        intervene_layers=args.intervene_layers,
                        intervene_tokens=args.intervene_tokens or (0,),
                        n_bootstrap=args.bootstrap,
                        seed=args.seed,
                        sink_epsilon=args.sink_epsilon,
                        quantization=args.quantization or (),
                    )
                except ValueError as e:
                    raise CLIError(first_line(e)) from e
                alive = weakref.ref(model)
                del model
            collect_if_alive(alive)  # before the next model loads
            _print_rows(f"{name:<20} " if several else "", rows)
        if several:
            write_comparison(stage, dict(zip(names, args.model)))
    print(f"wrote {out / ('comparison.png' if several else 'summary.md')}")
    return 0
