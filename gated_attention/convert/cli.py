"""`gated-attention convert | extend | export`.

Everything that can be checked without reading SRC (option values and their combinations, whether SRC and
DST are where they should be) is checked before anything heavy is imported: a wrong command line is
answered at once, also on a busy machine.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ..cli_common import add_push_to_hub, add_revision, bounded, memory_size
from .export_layouts import LAYOUTS

DEFAULT_SHARD_SIZE = 5 * 10**9  # huggingface_hub's and transformers' default, "5GB"
_INIT_HELP = (
    "exact (default): gate weight 0 so every score is sigmoid(0) = 0.5, and o_proj doubled; the logits are "
    "bit-identical to SRC's. bias: gate bias +10 so every score is sigmoid(10) = 0.99995 and o_proj unchanged; "
    "near-identity, NOT exact, and the gate's gradient is tiny at first (scaled by sigmoid'(10) = 4.5e-5)"
)


def _shard_size(text: str) -> int:
    """A size as huggingface_hub's sharding reads it ("5GB", "500MB": KB, MB, GB, TB, powers of 10), in bytes."""
    # The parser `split_state_dict_into_shards_factory` itself applies to a string; huggingface_hub does
    # not re-export it.
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MB (units KB, MB, GB, TB), got {text!r}") from None
    except OverflowError:  # huggingface_hub multiplies a float: 400 digits are inf
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MB, got {text[:20]!r}... (too large)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above zero, got {text!r}")
    return size


def _add_common(p: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    p.add_argument("src", metavar="SRC", help="checkpoint folder, a Hub repo id (read from the local cache when it is there, "
                   "else downloaded), or a .gguf file (or a folder holding one), dequantized by transformers' GGUF loader")
    p.add_argument(
        "dst",
        metavar="DST",
        help="output folder; written into .DST.incomplete-PID beside it and renamed to DST when complete, "
        "only if nothing is at DST then (unless --overwrite)",
    )
    if dtype:
        p.add_argument(
            "--dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            default="auto",
            help="dtype of the written floating-point weights (default: as stored in SRC)",
        )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it exists (also if it appears while writing), and remove the .DST.incomplete-PID / "
        ".DST.replaced-PID folders a killed run left beside it (without it they are named, and left)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip running both models to compare their outputs; SRC's weights are still checked for NaN and inf",
    )
    p.add_argument(
        "--max-memory",
        type=memory_size,
        metavar="SIZE",
        help="the most memory the verification's whole process may hold, Python, torch and the libraries included, "
        "e.g. 8GB or 512MiB (default: what the machine has free when the command starts). SRC and the result are "
        "loaded one after the other; accelerate keeps what fits in SIZE, less what the process holds already and "
        "a reserve for running, and reads the other layers from their own safetensors files while the fixed prompt "
        "runs, so the comparison stays bit-exact at any model size. The split (this process, running reserve, "
        "weights) is printed once, at the start of the verification, before SRC loads; what the process holds is "
        "measured after a miniature model has loaded and run once, so that what a first run adds for good is in it. "
        "Refused, before anything is written, if SIZE cannot hold the process, the running reserve and the largest "
        "layer. The conversion itself holds one tensor at a time",
    )
    p.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default=DEFAULT_SHARD_SIZE,
        metavar="SIZE",
        help="largest output shard, e.g. 5GB or 500MB (default: 5GB); a tensor larger than SIZE gets a shard of its own",
    )
    add_revision(p)
    add_push_to_hub(p)


def _add_rope(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("RoPE / YaRN")
    g.add_argument("--rope-theta", type=float, metavar="THETA", help="new RoPE base (rope_theta), a positive number")
    g.add_argument(
        "--yarn-factor",
        type=float,
        metavar="FACTOR",
        help="YaRN context extension factor (> 1); max_position_embeddings becomes FACTOR x "
        "--original-max-position-embeddings",
    )
    g.add_argument(
        "--original-max-position-embeddings",
        type=bounded(int, 1),
        metavar="N",
        help="context length SRC was trained at; required with --yarn-factor (YaRN's ramp is computed from it)",
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE/Mixtral/Phi-3/fla-hybrid checkpoint into a gated model, outputs unchanged",
        description="Convert a checkpoint into a gated-attention model: Llama (incl. llama3 RoPE), Mistral, "
        "Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, Phi-3, an fla Gated DeltaNet hybrid (fla's `attn` layer list), or one "
        "of the Gated Attention paper's released checkpoints (their gate kept; their code is never run). With the "
        "default --init exact the result's logits are bit-identical to SRC's (checked after writing unless "
        "--no-verify; SRC's weights are checked for NaN and inf before anything is written). One tensor is in "
        "memory at a time; DST appears only when complete.",
    )
    _add_common(p)
    p.add_argument("--gate", choices=["elementwise", "headwise"],
                   help="gate granularity: one score per channel or per head (default: elementwise; for the Gated "
                   "Attention paper's own checkpoints, their own gate, kept as trained, and none for their baseline)")
    p.add_argument("--init", choices=["exact", "bias"], default="exact", help=_INIT_HELP)
    p.add_argument("--gate-rank", type=bounded(int, 1), metavar="R",
                   help="a low-rank gate, sigmoid(W_up W_down x) through R values (spec key attn_gate.rank); "
                        "--init exact starts W_up at 0 (every score sigmoid(0) = 0.5, exact) and W_down at the first "
                        "R rows of the identity, so W_up learns from the start")
    p.add_argument("--gate-input-channels", type=bounded(int, 1), metavar="D",
                   help="the gate reads only the first D channels of the layer input (attn_gate.input_channels); "
                        "exact like the full gate")
    p.add_argument("--allow-pickle", action="store_true", help="read SRC's pytorch_model*.bin (when it has no safetensors) with torch.load(weights_only=True)")
    _add_rope(p)
    p.set_defaults(func=run_convert)

    p = subparsers.add_parser(
        "extend",
        help="RoPE base change and/or YaRN on a gated checkpoint",
        description="Write a copy of a gated checkpoint with new rope_parameters (weights unchanged): give --rope-theta "
        "and/or --yarn-factor with --original-max-position-embeddings.",
    )
    _add_common(p)
    _add_rope(p)
    p.set_defaults(func=run_extend)

    p = subparsers.add_parser(
        "export",
        help="gated model -> a transformers-native architecture, where the mapping is exact",
        description="Export a gated dense or hybrid model to transformers' native Qwen3.5 text layout (Qwen3_5ForCausalLM): "
        "gate interleaved into q_proj per head, (1 + w) norms, full rotary. Refuses, saying why, where that is not exact.",
    )
    _add_common(p, dtype=False)
    p.add_argument("--format", choices=["qwen3_5"], required=True, help="target architecture")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="text",
        help="the config layout, for the engine that reads it (the weights are the same). text (default): "
        "model_type qwen3_5_text, for transformers, vLLM and llama.cpp. mlx: the Hub's Qwen3.5 layout (model_type "
        "qwen3_5, the text model under text_config), for mlx-lm; transformers loads it too, but from 5.18 gives "
        "it Qwen3.5's own tokenizer class (a warning says when that tokenizes differently)",
    )
    p.set_defaults(func=run_export)


def _rope_change(args):
    from .rope import RopeChange

    return RopeChange(args.rope_theta, args.yarn_factor, args.original_max_position_embeddings)


def _user_errors(run):
    """Check SRC and DST (and --push-to-hub's repo id) as far as that needs no reading, run, then push DST
    where asked; a ConversionError (bad input) or a failed push is the CLI's one-line error. Nothing here
    imports torch, and the commands check their options before they import what they run: a wrong command
    line is answered before torch is imported."""

    @functools.wraps(run)
    def wrapper(args) -> int:
        from .. import CLIError
        from ..configuration.validation import ConfigError, check_config_file
        from ..hub.gguf import GGUFError, gguf_file
        from ..hub.push import PushFailed, push_folder, push_problem
        from .errors import ConversionError
        from .folders import check_destination, check_source

        try:
            if problem := push_problem(args):
                raise CLIError(problem)
            check_source(args.src, args.revision)
            local = Path(args.src).expanduser()
            check_destination(local if local.exists() else None, Path(args.dst), args.overwrite)
            if local.is_dir() and gguf_file(local) is None:  # a Hub SRC's config is checked once downloaded
                check_config_file(local, "SRC config.json")
            status = run(args)
            if args.push_to_hub:  # DST is in place and verified (or --no-verify said otherwise) by now
                url = push_folder(args.dst, args.push_to_hub, private=args.private,
                                  command=f"gated-attention {args.command} {args.src}")
                print(f"pushed {args.dst} to {url}")
            return status
        except PushFailed as e:
            raise CLIError(str(e)) from None
        except (ConversionError, ConfigError) as e:
            raise CLIError(str(e)) from None
        except GGUFError as e:
            raise CLIError(f"SRC {e}") from None

    return wrapper


@_user_errors
def run_convert(args) -> int:
    rope = _rope_change(args)
    from .convert import convert_checkpoint

    convert_checkpoint(
        args.src,
        args.dst,
        gate=args.gate,
        init=args.init,
        gate_rank=args.gate_rank,
        gate_input_channels=args.gate_input_channels,
        dtype=args.dtype,
        rope=rope,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        verify=args.verify,
        max_memory=args.max_memory,
        max_shard_size=args.max_shard_size,
        revision=args.revision,
    )
    return 0


@_user_errors
def run_extend(args) -> int:
    rope = _rope_change(args)
    rope.check_not_empty()
    from .convert import extend_checkpoint

    extend_checkpoint(
        args.src,
        args.dst,
        rope=rope,
        dtype=args.dtype,
        overwrite=args.overwrite,
        verify=args.verify,
        max_memory=args.max_memory,
        max_shard_size=args.max_shard_size,
        revision=args.revision,
    )
    return 0


@_user_errors
def run_export(args) -> int:
    from .export import export_checkpoint

    export_checkpoint(
        args.src,
        args.dst,
        format=args.format,
        layout=args.layout,
        overwrite=args.overwrite,
        verify=args.verify,
        max_memory=args.max_memory,
        max_shard_size=args.max_shard_size,
        revision=args.revision,
    )
    return 0
