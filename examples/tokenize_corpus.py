"""Tokenize a corpus once into token shards that training memory-maps and reads at random.

    python examples/tokenize_corpus.py --model ./llama-gated --dataset data/*.jsonl --output data/tokens
    accelerate launch examples/continued_pretraining.py --model ./llama-gated --dataset data/tokens ...

The shards are the token stream (every document followed by EOS) as flat
uint16 files (uint32 when the vocabulary has more than 65,536 tokens), split
every `--shard-tokens` tokens, with an `index.json` naming the files, their
lengths and the tokenizer. Any `--seq-len` can be trained from them; rows are
shuffled by (seed, step) as in memory, so a resume needs nothing but the step.
The folder appears complete or not at all. `--dataset` takes what
`continued_pretraining.py --dataset` takes.
"""

from __future__ import annotations

import sys
import time
from typing import NoReturn

from gated_attention.cli_common import OneLineErrorParser, bounded, first_line
from gated_attention.recipes.settings import MIN_VOCAB
from gated_attention.training.data import tokenizer_for
from gated_attention.files.datasets import DataError
from gated_attention.training.streaming import write_token_shards


def main(argv: list[str] | None = None) -> dict:
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model folder or Hub id whose tokenizer to use")
    p.add_argument("--dataset", required=True, nargs="+", metavar="SPEC")
    p.add_argument("--text-field", default="text")
    p.add_argument("--split", help="split of a --dataset folder, saved dataset or Hub id (default: train)")
    p.add_argument("--output", required=True, help="new folder for the shards")
    p.add_argument("--shard-tokens", type=bounded(int, 1), default=1 << 28, help="tokens per shard file")
    p.add_argument("--vocab-size", type=bounded(int, MIN_VOCAB),
                   help="for a model folder without a tokenizer: the embedded one of this size")
    p.add_argument("--trust-remote-code", action="store_true")
    args = p.parse_args(argv)
    try:
        tokenizer = tokenizer_for(args.model, vocab_size=args.vocab_size, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(f"--model {args.model}: no usable tokenizer ({first_line(e)}); for a model folder without one, "
             "--vocab-size picks the embedded tokenizer")
    spec = args.dataset if len(args.dataset) > 1 else args.dataset[0]
    t0 = time.perf_counter()
    try:
        index = write_token_shards(spec, tokenizer, args.output, text_field=args.text_field, split=args.split,
                                   shard_tokens=args.shard_tokens)
    except DataError as e:
        fail(str(e))
    seconds = time.perf_counter() - t0
    print(f"wrote {args.output}: {index['tokens']:,} tokens ({index['dtype']}) in {len(index['shards'])} shard(s), "
          f"{seconds:.1f} s ({index['tokens'] / seconds:,.0f} tokens/s)")
    return index


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2 (as the training examples do)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
