"""Peak memory of streaming one very long document, against the same text in short documents, in one run.

    python benchmarks/long_document.py                 # a 50 MB text: one jsonl line, and 2,000-character lines
    python benchmarks/long_document.py --mb 10 --line-chars 500

Writes one text twice under `--folder` (kept for reruns): as a single
`{"text": ...}` line, and cut into `--line-chars`-character documents, one per
line. The text is the embedded corpus (Python's docs and sources) repeated to
`--mb` megabytes; it holds some non-ASCII characters, so Python keeps it at two
bytes per character, as it would most web text. Then, in a fresh process per
file, reads the stream through what `training.train` reads it with
(`StreamBatches` over a `PackedStream`, one process, the embedded BPE
tokenizer) until the whole text has been read once, and prints each process's
peak RSS, its RSS after the imports, and the ratio of the two peaks: a
document of any length should cost no more than the same text in short
documents.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.training import data


def write_corpora(folder: Path, size_mb: int, line_chars: int) -> tuple[Path, Path]:
    """(one line holding the whole text, the same text in `line_chars`-character lines)."""
    long_path, short_path = folder / f"one-line-{size_mb}mb.jsonl", folder / f"lines-{size_mb}mb-{line_chars}.jsonl"
    if long_path.exists() and short_path.exists():
        return long_path, short_path
    corpus = "\n\n".join(d.text for d in data.corpus_documents())
    text = (corpus * (size_mb * 1_000_000 // len(corpus) + 1))[: size_mb * 1_000_000]
    lines = (text[i : i + line_chars] for i in range(0, len(text), line_chars))
    for path, docs in ((long_path, [text]), (short_path, lines)):
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        tmp.rename(path)
    return long_path, short_path


def peak_rss_mb() -> float:
    """This process's peak RSS. Linux's VmHWM starts afresh at exec; getrusage's ru_maxrss does not (it
    would count the parent's peak before the fork: the 200 MB corpus it wrote)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(corpus: str, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """Runs in its own process: the data path alone, until the stream has read the whole file once."""
    from gated_attention.training import StreamBatches
    from gated_attention.training.streaming import text_stream

    tokenizer = data.load_tokenizer(vocab_size)
    stream = text_stream(corpus, tokenizer, seq_len)
    batches = StreamBatches(stream, batch_size, grad_accum=1)
    rss_start = peak_rss_mb()
    t0 = time.perf_counter()
    step = 0
    while stream.state_dict()["epoch"] == 0:
        batches.step(step)
        step += 1
    seconds = time.perf_counter() - t0
    return {"corpus": corpus, "steps": step, "tokens": step * batch_size * seq_len, "seconds": seconds,
            "rss_after_imports_mb": rss_start, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=bounded(int, 1), default=50, help="size of the text in MB (10^6 characters)")
    p.add_argument("--line-chars", type=bounded(int, 1), default=2000, help="characters per short document")
    p.add_argument("--folder", default="/tmp/gated-attention-long-document-bench")
    p.add_argument("--batch-size", type=bounded(int, 1), default=8)
    p.add_argument("--seq-len", type=bounded(int, 2), default=1024)
    p.add_argument("--vocab-size", type=bounded(int, 1), default=1024,
                   help="the embedded tokenizer's (quickstart's default)")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the child process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.batch_size, args.seq_len, args.vocab_size)))
        return

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    data.load_tokenizer(args.vocab_size)  # trained once here, not inside a measured process
    results = {}
    for name, corpus in zip(("one document", f"{args.line_chars}-character documents"),
                            write_corpora(folder, args.mb, args.line_chars)):
        cmd = [sys.executable, __file__, "--measure", str(corpus), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        results[name] = r
        print(f"{args.mb} MB as {name}: {r['steps']} steps x {args.batch_size} x {args.seq_len} tokens "
              f"({r['tokens']:,} tokens) in {r['seconds']:.1f} s; RSS after imports "
              f"{r['rss_after_imports_mb']:,.0f} MB, peak {r['peak_rss_mb']:,.0f} MB", flush=True)
    (one, lines) = results.values()
    print(f"peak RSS: {one['peak_rss_mb']:,.0f} MB (one document) vs {lines['peak_rss_mb']:,.0f} MB "
          f"({args.line_chars}-character documents): ratio {one['peak_rss_mb'] / lines['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    main()
