"""`gated-attention analyze MODEL --out DIR`: sink, activation, gate and spike/plateau metrics.

Option values, paths and MODEL's whereabouts are checked before torch is imported. A Hub id is looked
up with one request first: huggingface_hub retries every file for about a minute when the Hub cannot
be reached, so an id that is not cached fails at once instead, and a cached one loads from the cache
(`_resolve`).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from .. import CLIError
from ..hub.command_line import bounded, first_line
from ..hub.repo_ids import missing_folder

DTYPES = ("float32", "bfloat16", "float16", "auto")
# `interventions.KINDS`, written out so that building the parser imports no torch (tests/test_cli.py checks they agree)
INTERVENTIONS = ("deletion", "connection")
# torch device strings: a device type, optionally with an index (`torch.device` would need torch to parse)
_DEVICE = re.compile(r"^(auto|cpu|mps|(cuda|xpu|npu|hpu|mtia)(:\d+)?)$")
HUB_TIMEOUT_S = 10  # the one request that asks the Hub whether MODEL exists


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N, mps, xpu or xpu:N, got {text!r}")
    return text


def _text_file(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'is a folder, not a file' if path.is_dir() else 'no such file'}")
    return text


def _out_dir(text: str) -> str:
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return text


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="attention-sink, massive-activation, gate and spike/plateau metrics of a causal LM",
        description=(
            "Capture the residual stream, attention maps (eager attention) and gate scores of MODEL on "
            "built-in prose/code/math samples (or --text-file), and write arrays.npz, tidy CSV tables, "
            "PNG plots and summary.md to DIR. Metric definitions: README.md, 'analyze', and gated_attention/analysis/metrics.py."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="local model folder or Hugging Face Hub id")
    p.add_argument("--out", required=True, metavar="DIR", type=_out_dir, help="output folder (created if missing)")
    p.add_argument("--text-file", metavar="PATH", type=_text_file,
                   help="UTF-8 text, one input per blank-line-separated paragraph (default: the built-in samples)")
    p.add_argument("--n-per-domain", type=bounded(int, 1), default=4, metavar="N",
                   help="built-in samples per domain: prose, code, math (default: %(default)s)")
    p.add_argument("--max-length", type=bounded(int, 2), default=128, metavar="T",
                   help="tokens per input, at most: longer inputs are cut to T tokens, or to the model's "
                   "max_position_embeddings where that is smaller, with a warning (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="PATH_OR_ID", help="tokenizer folder or Hub id (default: MODEL's)")
    p.add_argument("--device", type=_device, default="auto",
                   help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, ... (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with the checkpoint")
    p.add_argument("--intervene", choices=INTERVENTIONS, help="also report perplexity/accuracy with this intervention")
    p.add_argument("--k", type=int, choices=(1, 2, 4), default=1,
                   help="coordinates per attention input for --intervene (default: %(default)s)")
    p.add_argument("--bootstrap", type=bounded(int, 1), default=1000, metavar="N",
                   help="bootstrap resamples for the confidence intervals (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    p.set_defaults(func=run)


def _check_names(args) -> None:
    """MODEL and --tokenizer: an existing folder, or what can be a Hub id."""
    if not args.model.strip():  # Path("") is the working folder
        raise CLIError("MODEL is empty: give a model folder or a Hub repo id")
    if missing_folder(args.model):
        raise CLIError(f"model folder not found: {args.model}")
    if args.tokenizer and missing_folder(args.tokenizer):
        raise CLIError(f"--tokenizer folder not found: {args.tokenizer}")


def _check_out(args) -> None:
    """--out: not the working folder or above it, not MODEL's folder, and, if it holds anything, an earlier
    analysis (its arrays.npz is written first), whose files this run replaces."""
    from ..hub.output_folders import OutputFolderError, check_output_folder, holds_any

    inputs = {}
    for flag, name in (("MODEL", args.model), ("--tokenizer", args.tokenizer)):
        if name and Path(name).expanduser().exists():
            inputs[flag] = Path(name).expanduser()
    try:
        check_output_folder(args.out, flag="--out", what="the output of an earlier analyze (arrays.npz, summary.md)",
                            ours=holds_any("arrays.npz", "summary.md"), inputs=inputs)
    except OutputFolderError as e:
        raise CLIError(str(e)) from None


def _check_config(name: str, resolved: str) -> None:
    """MODEL's config.json, checked before the model is built: a million layers would allocate for minutes."""
    from ..configuration.validation import ConfigError, check_config_file

    if Path(resolved).is_dir():  # a local folder or a cached snapshot; a Hub id loads its config when loading
        try:
            check_config_file(resolved, f"MODEL {name} config.json")
        except ConfigError as e:
            raise CLIError(str(e)) from None


def _resolve(name: str) -> str:
    """`name` to load: itself (a folder, or a Hub id the Hub answers for), or the folder of its snapshot in
    the Hugging Face cache when the Hub cannot be reached (then nothing asks the Hub).

    One request (`model_info`, which huggingface_hub does not retry) tells an id the Hub does not know
    and a Hub that does not answer; a failed download would be retried for every file, for a minute.
    """
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if constants.HF_HUB_OFFLINE:
        return name  # offline mode: huggingface_hub reads the cache and never asks the Hub
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
        return name
    except RepositoryNotFoundError as e:
        raise CLIError(f"{name!r} is no local folder and no model on the Hub ({first_line(e)})") from None
    except HfHubHTTPError:
        return name  # the Hub answered (a gated repo, a server error, ...): loading says what it means
    except Exception as e:  # noqa: BLE001 - no answer at all: no network, DNS, proxy, timeout
        unreachable = first_line(e)
    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise CLIError(
            f"cannot load model {name!r}: it is no local folder, not in the Hugging Face cache, and the Hub "
            f"cannot be reached ({unreachable})"
        ) from None


def _load(args, where: dict[str, str]):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import register_auto_classes

    register_auto_classes()  # MODEL may be one of ours, loaded without remote code

    tokenizer_name = args.tokenizer or args.model
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    # flash-linear-attention (fla) registers its model types (gla, retnet, hgrn, delta_net, gated_deltanet, ...)
    # with the Auto classes when it is imported, and `mamba`/`mamba2` over transformers' own: so it is
    # imported only for a model type transformers does not know. Its models are built inside
    # fla_torch_paths(): its attention layer cannot be built without flash-attn otherwise.
    import contextlib
    import importlib.util

    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..kernels import fla_torch_paths

    building = contextlib.nullcontext()
    try:
        config_dict = PretrainedConfig.get_config_dict(where[args.model])[0]
    except Exception:  # noqa: BLE001 - from_pretrained below says what is wrong with the folder
        config_dict = {}
    model_type = config_dict.get("model_type")
    if model_type and model_type not in CONFIG_MAPPING and "auto_map" not in config_dict:  # not remote code
        if importlib.util.find_spec("fla") is None:
            raise CLIError(
                f"cannot load model {args.model!r}: transformers does not know its model type {model_type!r}, and "
                "flash-linear-attention, whose models register their types, is not installed "
                "(pip install flash-linear-attention)"
            )
        import fla  # noqa: F401 - registers fla's model types with the Auto classes

        if model_type in CONFIG_MAPPING:
            building = fla_torch_paths()
    try:
        with building:
            model = AutoModelForCausalLM.from_pretrained(where[args.model], dtype=dtype, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loading failure is one line for the user
        raise CLIError(f"cannot load model {args.model!r}: {first_line(e)}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(where[tokenizer_name], trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot load a tokenizer from {tokenizer_name!r} (pass --tokenizer): {first_line(e)}") from e
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = model.to(device).eval()
    except Exception as e:  # noqa: BLE001
        raise CLIError(f"cannot move the model to {device!r}: {first_line(e)}") from e
    return model, tokenizer


def run(args) -> int:
    from .samples import read_text_file

    _check_names(args)
    _check_out(args)
    where = {name: _resolve(name) for name in dict.fromkeys([args.model, args.tokenizer or args.model])}
    _check_config(args.model, where[args.model])
    if args.text_file:
        try:
            samples = read_text_file(args.text_file)
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --text-file: {first_line(e)}") from e
        if not samples:
            raise CLIError(f"--text-file {args.text_file} holds no text")
    else:
        from .samples import builtin_samples

        samples = builtin_samples(args.n_per_domain)

    from .analyze import run_analysis

    model, tokenizer = _load(args, where)
    out = Path(args.out)
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
        raise CLIError(first_line(e)) from e
    for row in rows:
        if row["metric"] in ("f_attn", "m_act", "gate_mean", "sink_spike_alignment", "inter_spike_retention"):
            value = "undefined" if math.isnan(row["mean"]) else f"{row['mean']:.4g}"
            print(f"{row['metric']:<24} {row['anchor']:<15} {value}")
    print(f"wrote {out / 'summary.md'}")
    return 0
