"""Peak memory and speed of the streamed data path (`gated_attention.training.streaming`) at two corpus sizes.

    python benchmarks/stream_memory.py                   # 100 MB and 1 GB jsonl corpora under /tmp
    python benchmarks/stream_memory.py --sizes-mb 10 100 --steps 200

Writes one jsonl corpus per size (documents are random slices of the embedded
corpus, one `{"text": ...}` per line; kept for reruns), then, in a fresh
process per corpus, reads the same number of training steps through what
`training.train` reads them with (`StreamBatches` over a `PackedStream`, one
process, the embedded BPE tokenizer), and prints the peak RSS of that process,
its RSS after the imports, and the data path's tokens/s (reading, tokenizing,
packing; no model). The ratio of the two peaks is the claim: memory does not
grow with the corpus. Steps default to more tokens than the smallest corpus
holds, so that one wraps into a second epoch.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.training import data


def write_corpus(path: Path, size_mb: int, seed: int = 0) -> Path:
    if path.exists() and path.stat().st_size >= size_mb * 1_000_000:
        return path
    rng = random.Random(seed)
    texts = [d.text for d in data.corpus_documents()]
    pool = []
    for _ in range(20_000):  # documents of 200 to 8,000 characters
        t = rng.choice(texts)
        n = rng.randint(200, 8_000)
        start = rng.randrange(max(1, len(t) - n))
        pool.append(json.dumps({"text": t[start : start + n]}) + "\n")
    tmp = path.with_suffix(".tmp")
    written, target = 0, size_mb * 1_000_000
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            line = rng.choice(pool)
            f.write(line)
            written += len(line)
    tmp.rename(path)
    return path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(corpus: str, steps: int, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """Runs in its own process: the data path alone for `steps` steps."""
    from gated_attention.training.streaming import text_stream
    from gated_attention.training import StreamBatches

    tokenizer = data.load_tokenizer(vocab_size)
    stream = text_stream(corpus, tokenizer, seq_len)
    batches = StreamBatches(stream, batch_size, grad_accum=1)
    rss_start = peak_rss_mb()
    t0 = time.perf_counter()
    for step in range(steps):
        batches.step(step)
    seconds = time.perf_counter() - t0
    tokens = steps * batch_size * seq_len
    return {"corpus": corpus, "steps": steps, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "epoch": stream.state_dict()["epoch"], "rss_after_imports_mb": rss_start, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", type=bounded(int, 1), nargs=2, default=[100, 1000])
    p.add_argument("--folder", default="/tmp/gated-attention-stream-bench")
    p.add_argument("--steps", type=bounded(int, 1), default=5000)
    p.add_argument("--batch-size", type=bounded(int, 1), default=8)
    p.add_argument("--seq-len", type=bounded(int, 1), default=1024)
    p.add_argument("--vocab-size", type=bounded(int, 1), default=1024,
                   help="the embedded tokenizer's (quickstart's default)")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the child process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps, args.batch_size, args.seq_len, args.vocab_size)))
        return

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    data.load_tokenizer(args.vocab_size)  # trained once here, not inside a measured process
    results = []
    for size in args.sizes_mb:
        t0 = time.perf_counter()
        corpus = write_corpus(folder / f"corpus-{size}mb.jsonl", size)
        print(f"corpus {corpus}: {corpus.stat().st_size / 1e6:,.0f} MB (ready in {time.perf_counter() - t0:.0f} s)",
              flush=True)
        cmd = [sys.executable, __file__, "--measure", str(corpus), "--steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"  {r['steps']} steps x {args.batch_size} x {args.seq_len} tokens = {r['tokens']:,} tokens in "
              f"{r['seconds']:.1f} s: {r['tokens_per_s']:,.0f} tokens/s (data path alone, one process); "
              f"ended in epoch {r['epoch']}; RSS after imports {r['rss_after_imports_mb']:,.0f} MB, "
              f"peak {r['peak_rss_mb']:,.0f} MB", flush=True)
    small, large = results
    print(f"peak RSS: {small['peak_rss_mb']:,.0f} MB ({args.sizes_mb[0]} MB corpus) vs "
          f"{large['peak_rss_mb']:,.0f} MB ({args.sizes_mb[1]} MB corpus): ratio "
          f"{large['peak_rss_mb'] / small['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    main()
