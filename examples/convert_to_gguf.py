"""An exported checkpoint -> GGUF, with llama.cpp's own converter, for a tokenizer llama.cpp has not seen.

    gated-attention export ./my-hybrid ./my-hybrid-native --format qwen3_5
    python examples/convert_to_gguf.py ./my-hybrid-native my-hybrid.gguf \\
        --converter llama.cpp/convert_hf_to_gguf.py -- --no-mtp --outtype f32

Everything after `--` goes to `convert_hf_to_gguf.py` unchanged (`--no-mtp`:
our exports have no multi-token-prediction head). Run it in this project's
environment (the converter needs torch, transformers and numpy); llama.cpp's
`gguf-py` is taken from the converter's own source tree.

Why a wrapper: llama.cpp recognises a BPE tokenizer's pre-tokenizer by hashing
the token ids of a fixed test string, so it knows only the vocabularies listed
in its converter. A tokenizer trained by this package (quickstart's embedded
byte-level BPE) is new to it, and the converter stops with "BPE pre-tokenizer
was not recognized". That tokenizer pre-tokenizes exactly as GPT-2 does: its
`tokenizer.json` declares `ByteLevel` with GPT-2's regex (`use_regex: true`)
and no prefix space. For such a tokenizer, and only then, this script answers
llama.cpp's question with its name for that scheme, `gpt-2`; any other
unrecognised tokenizer still stops the converter, as it should. Tokenizers
llama.cpp knows are untouched. `benchmarks/serving_check.py` checks that
llama.cpp then tokenizes text exactly as transformers does.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser

GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}
LLAMA_CPP_NAME = "gpt-2"  # llama.cpp's tokenizer.ggml.pre for GPT-2's byte-level regex


def declares_gpt2_pre_tokenization(model_dir: Path) -> bool:
    """Whether `tokenizer.json` pre-tokenizes exactly as GPT-2: byte-level, GPT-2's regex, no prefix space."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = spec.get("pre_tokenizer") or {}
    return spec.get("normalizer") is None and all(pre.get(k) == v for k, v in GPT2_PRE_TOKENIZER.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="an exported checkpoint folder (gated-attention export --format qwen3_5)")
    p.add_argument("outfile", type=Path, help="the GGUF file to write")
    p.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    args = p.parse_args(ours)
    if not args.converter.is_file():
        p.error(f"--converter {args.converter} is not a file (it is convert_hf_to_gguf.py in llama.cpp's source tree)")
    if not (args.model / "config.json").is_file():
        p.error(f"{args.model} has no config.json")

    sys.path[:0] = [str(args.converter.parent), str(args.converter.parent / "gguf-py")]
    from conversion import base  # llama.cpp's converter package, beside convert_hf_to_gguf.py

    recognise = base.TextModel.get_vocab_base_pre
    gpt2_like = declares_gpt2_pre_tokenization(args.model)

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            if not gpt2_like:
                raise
            print(f"convert_to_gguf: {args.model}'s tokenizer is new to llama.cpp; it declares GPT-2's "
                  f"byte-level pre-tokenizer, so tokenizer.ggml.pre = {LLAMA_CPP_NAME!r}", file=sys.stderr)
            return LLAMA_CPP_NAME

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(args.converter), str(args.model), "--outfile", str(args.outfile), *theirs]
    try:
        runpy.run_path(str(args.converter), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
