"""`gated-attention stream MODEL --text-file F --window W --sink-tokens 0 4 --out DIR`: StreamingLLM's measurement.

One text, streamed a token at a time through `SinkCache(W, K)` for each K of `--sink-tokens`
(`analysis/stream.py`), to DIR/stream.csv (sink_tokens, window, tokens, ppl), stream.npz and stream.png.
It measures; it trains nothing.

Options, paths and MODEL's whereabouts are checked before torch is imported, with the checks `analyze`
shares (`command_checks`). DIR follows the output-folder rules of the other commands: written beside
itself and renamed into place when whole, an earlier stream output there replaced whole, any other
non-empty folder refused, never the working folder, MODEL or the text file's folder; a failure or Ctrl-C
leaves DIR as it was.
"""

from __future__ import annotations

from pathlib import Path

from .. import CLIError
from ..cli_common import add_revision, bounded, device_name, existing_file, first_line, memory_size
from .command_checks import check_config, check_names, check_out, out_dir, resolve, staged_output

DTYPES = ("float32", "bfloat16", "float16")
# A text is read at most this many characters per token of --max-tokens: more than any token covers.
CHARS_PER_TOKEN = 1024
# What a stream writes in DIR (`stream.write_stream`): a folder holding one of them may be replaced whole.
STREAM_FILES = ("stream.csv", "stream.npz", "stream.png")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "stream",
        help="windowed perplexity over a long text with StreamingLLM's cache, with and without sink tokens",
        description=(
            "Stream the text of --text-file through MODEL one token at a time with StreamingLLM's cache "
            "(gated_attention.SinkCache): each token attends to the --window entries the cache holds (the first K "
            "tokens, the sinks, and the most recent ones) and to itself. Perplexity for each K of --sink-tokens, and for full attention where the text "
            "fits the model's positions, goes to DIR/stream.csv (sink_tokens, window, tokens, ppl), stream.npz "
            "(per-token NLL) and stream.png. A model that needs its attention sink breaks when the window evicts "
            "the first token and recovers with a few sinks kept; a sink-free one should not need them. "
            "docs/streaming.md has the cache, the RoPE handling and the measured tables."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="local model folder, Hugging Face Hub id, or .gguf file (dequantized by "
                   "transformers' GGUF loader)")
    p.add_argument("--text-file", required=True, metavar="PATH", type=existing_file,
                   help="UTF-8 text streamed as one sequence; it must be longer than --window (StreamingLLM: many times)")
    p.add_argument("--window", required=True, type=bounded(int, 2), metavar="W",
                   help="entries the cache holds, sinks included (StreamingLLM's cache size; the removed transformers "
                   "SinkCache's window_length)")
    p.add_argument("--sink-tokens", nargs="+", type=bounded(int, 0), default=[0, 4], metavar="K",
                   help="numbers of first tokens kept as sinks, one run each, each below --window (default: 0 4)")
    p.add_argument("--max-tokens", type=bounded(int, 3), metavar="T",
                   help="stream only the text's first T tokens (default: all of them)")
    p.add_argument("--out", required=True, metavar="DIR", type=out_dir,
                   help="output folder, created whole at the end; an earlier stream output there is replaced")
    p.add_argument("--tokenizer", metavar="PATH_OR_ID", help="tokenizer folder or Hub id (default: MODEL's)")
    add_revision(p, "MODEL")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (cuda if available, else cpu), cpu, cuda, cuda:N, ... (default: %(default)s)")
    p.add_argument("--max-memory", type=memory_size, metavar="SIZE",
                   help="the most CPU memory the process may hold, e.g. 4GB; layers that do not fit are read from the "
                   "checkpoint as they run, which a token-at-a-time stream makes slow (default: what is free)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code shipped with the checkpoint")
    p.set_defaults(func=run)


def _check(args) -> None:
    """Everything that can be checked without torch: sink counts, MODEL's whereabouts, DIR."""
    for k in args.sink_tokens:
        if k >= args.window:
            raise CLIError(f"--sink-tokens {k} must be below --window {args.window} (the sinks are part of the window)")
    if len(set(args.sink_tokens)) != len(args.sink_tokens):
        raise CLIError(f"--sink-tokens {' '.join(map(str, args.sink_tokens))} names a count twice")
    check_names([args.model], args.tokenizer, args.revision)
    check_out(args.out, [args.model], args.tokenizer, what="the output of an earlier stream (stream.csv)",
              ours=STREAM_FILES, inputs={"--text-file": Path(args.text_file).expanduser()})


def _tokens(tokenizer, path: str, max_tokens: int | None, window: int):
    """The text's token ids `[1, T]`, cut to `max_tokens`; refused when nothing would leave a `window` cache."""
    import torch

    try:
        with open(Path(path).expanduser(), encoding="utf-8") as f:
            text = f.read(max_tokens * CHARS_PER_TOKEN if max_tokens else -1)
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read --text-file: {first_line(e)}") from e
    ids = tokenizer(text)["input_ids"][:max_tokens]
    if len(ids) <= window + 1:
        raise CLIError(f"--text-file {path} gives {len(ids)} tokens{' with --max-tokens' if max_tokens else ''}: a window "
                       f"of {window} evicts nothing from so few; give a longer text or a smaller --window")
    return torch.tensor([ids])


def _label(model: str) -> str:
    """MODEL as the plot's title names it: a path by its last part, a Hub id whole."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model


class _Bar:
    """One tqdm bar per run (`stream.run_stream`'s `bar`)."""

    def __init__(self, total: int, description: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=description, unit="tok")

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()
        return False


def run(args) -> int:
    _check(args)
    where = {name: resolve(name, args.revision if name == args.model else None) for name in dict.fromkeys([args.model, *([args.tokenizer] if args.tokenizer else [])])}
    check_config(args.model, where[args.model])

    from ..memory.budget import MemoryBudget
    from .loading import LoadOptions, check_device, loaded
    from .stream import run_stream

    # the longest forward is one window
    options = LoadOptions(dtype=args.dtype, device=args.device, tokenizer=args.tokenizer,
                          trust_remote_code=args.trust_remote_code, max_length=args.window)
    check_device(options)
    budget = MemoryBudget.resolve(args.max_memory)
    out = Path(args.out).expanduser()
    with staged_output(out) as stage, loaded(options, args.model, where, budget, stage) as (model, tokenizer):
        ids = _tokens(tokenizer, args.text_file, args.max_tokens, args.window).to(model.device)
        print(f"streaming {ids.shape[1]} tokens of {args.text_file} through a window of {args.window}")
        try:
            rows, full = run_stream(model, ids, args.window, args.sink_tokens, stage, _label(args.model), bar=_Bar)
        except ValueError as e:  # SinkCache's refusals: no RoPE, a length-dependent RoPE, no attention layer
            raise CLIError(first_line(e)) from e
    for row in rows:
        print(f"{row['sink_tokens']} sink tokens: ppl {row['ppl']:.4g} ({row['tokens']} tokens, window {row['window']})")
    if full is not None:
        print(f"full attention: ppl {full:.4g}")
    print(f"wrote {out / 'stream.csv'}")
    return 0
