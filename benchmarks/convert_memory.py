"""Peak memory and wall time of `convert` with its verification, and of `analyze`, at several memory budgets, in one run.

    python benchmarks/convert_memory.py                            # 0.84B bf16 Llama; budgets 1GB 4GB and none
    python benchmarks/convert_memory.py --shape 8b --budgets 6GB   # an 8B-shaped one (16 GB on disk, ~35 GB scratch)
    python benchmarks/convert_memory.py --parts analyze            # analyze only
    python benchmarks/convert_memory.py --src-dtype float32 --dtype bfloat16 --budgets 1.5GB --parts convert
                                                                   # a narrowing --dtype: fp32 SRC verified in bf16
    python benchmarks/convert_memory.py --budgets least            # the smallest budget each command accepts

Builds a Llama-shaped bf16 checkpoint (`--src-dtype float32`: fp32) with
random weights from a config (nothing is downloaded), then runs
`python -m gated_attention convert SRC DST` (with `--dtype` when given)
as a whole process for each budget (`--max-memory SIZE`; `none` is the
default, what the machine has free), and prints each run's wall time and peak
RSS (the kernel's high-water mark of the process, from wait4) beside:

- the time to read SRC's files once, from disk: the least any conversion
  needs, which reads SRC at least twice (the inf/NaN check and the copy) and
  the verification once more;
- `convert --no-verify`, the write alone;
- the peak RSS of a process that only imports what `convert` imports.

SRC's pages are dropped from the page cache (after a sync) before every timed
command, so each one reads SRC from disk as a first run would: the figures do
not depend on what an earlier row left in memory. Every command runs once; on
a shared machine, run the script again before believing a difference of a
few percent.

`analyze` runs on the same checkpoint with a byte-level BPE trained on the
built-in samples, 3 inputs cut to 128 tokens at each budget, in bf16 (the
checkpoint's dtype) and in analyze's default dtype (fp32: the layers read from
the checkpoint as they run are cast as they are read), and once more in bf16
cut to 1,024 tokens (the samples are 303, 617 and 706 tokens long) within
twice the first budget: `--max-memory` bounds the whole process, and its
reserve for running the model grows with the length asked for. Each row says
whether its peak RSS stayed within its `--max-memory`.

`--budgets least` is the smallest budget each command accepts: what its own
refusal of `--max-memory 1MB` adds up (the largest layer, the running reserve,
what the process holds when it checks), plus 2 MB for what the process holds
moving between runs. The weights then get almost no room, so what the process
adds after it measures itself decides whether the peak stays within.

`--parts` chooses what is measured; `PARTS` maps each part to the function that
returns its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, format_size, memory_size

REPO = Path(__file__).resolve().parents[1]
# TinyLlama-1.1B's layer shapes with 16 layers: 0.84B parameters, 1.67 GB in bf16.
SHAPES = {
    "0.85b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=4),
    # Llama-3-8B's shapes: 8.0B parameters, 16.1 GB in bf16.
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
}  # fmt: skip
# What a process holds when it checks the budget moves by a few hundred kB between runs of the same command.
JITTER = 2 * 10**6
# What a command's refusal of a budget names besides the budget: the layer, the running reserve, the process.
NEEDS = re.compile(r"needs (\S+ \S+) in \w+(?:, running the model (\S+ \S+) more)?(?: and|,) this process holds (\S+ \S+) already")
SHARD_BYTES = 2 * 10**9  # the builder holds one shard in memory; the 8B one has 9

# What `python -m gated_attention convert` imports before it reads a tensor (see benchmarks/convert.py).
IMPORTS_CONVERT = (
    "import sys; sys.argv[0] = '-m'; sys.orig_argv = [sys.executable, '-m', 'gated_attention']; "
    "from gated_attention.cli import build_parser; build_parser(); import gated_attention.convert.convert"
)
READ_ONCE = """
import sys
buffer = bytearray(64 << 20)
for name in sys.argv[1:]:
    with open(name, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
"""


def build_checkpoint(folder: Path, shape: str, dtype: str = "bfloat16") -> None:
    """Random weights (std 0.02, norms 1) in `dtype`, in shards of about SHARD_BYTES, with config and index."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, dtype=dtype)
    config.save_pretrained(folder)
    with torch.device("meta"):
        meta = {k: v.to(getattr(torch, dtype)) for k, v in LlamaForCausalLM(config).state_dict().items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=SHARD_BYTES)
    g = torch.Generator().manual_seed(0)
    for filename, names in split.filename_to_tensors.items():
        tensors = {}
        for n in names:
            # drawn in the stored dtype: fp32 values that bf16 rounds, so a narrowing --dtype is a real cast
            t = torch.empty(meta[n].shape, dtype=meta[n].dtype)
            tensors[n] = t.fill_(1.0) if n.endswith("norm.weight") else t.normal_(0, 0.02, generator=g)
        save_file(tensors, folder / filename, metadata={"format": "pt"})
        del tensors
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def evict(folder: Path) -> None:
    """Write back, then drop `folder`'s files from the page cache (this process's files only, nobody else's)."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# Runs a command and reports its wall time and peak RSS. The command is started from this small process, not
# from the benchmark's: a child's peak RSS counts the memory of the process it was forked from, and the
# benchmark imports the package (and with it torch) to parse its flags.
MEASURE = """
import json, os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump([time.perf_counter() - start, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)], f)
"""  # ru_maxrss is in KiB on Linux


@dataclass
class Run:
    wall_s: float
    peak_rss: int  # bytes
    out: str


def run(argv: list[str]) -> Run:
    """Wall seconds, peak RSS and stdout of one whole process (which must succeed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(report), *argv], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not report.exists():
            raise SystemExit(f"{' '.join(argv[:5])}... could not be measured:\n{proc.stderr[-2000:]}")
        wall, rss, code = json.loads(report.read_text())
    if code != 0:
        raise SystemExit(f"{' '.join(argv[:5])}... failed ({code}):\n{proc.stderr[-2000:]}")
    return Run(wall, rss, proc.stdout)


def least_budget(argv: list[str]) -> int:
    """The smallest `--max-memory` the command `argv` accepts, from its refusal of 1 MB (see the docstring)."""
    proc = subprocess.run([*argv, "--max-memory", "1MB"], cwd=REPO, capture_output=True, text=True)
    needs = NEEDS.search(proc.stderr)
    if proc.returncode != 2 or not needs:
        raise SystemExit(f"{' '.join(argv[:5])}... did not refuse 1 MB in one line:\n{proc.stderr[-2000:]}")
    return sum(memory_size(size.replace(" ", "")) for size in needs.groups() if size) + JITTER


@dataclass
class Row:
    name: str
    run: Run
    note: str = ""
    budget: int | None = None  # --max-memory: the peak RSS is checked against it


def convert_rows(src: Path, scratch: Path, budgets: list[int | None], dtype: str | None = None) -> list[Row]:
    """`convert` (`--dtype dtype` when given) with verification at each budget, and without verification."""
    py = sys.executable
    rows = []
    for budget in [*budgets, "no-verify"]:
        dst = scratch / "dst"
        command = [py, "-m", "gated_attention", "convert", str(src), str(dst), *(["--dtype", dtype] if dtype else [])]
        least = budget == "least"
        if least:
            budget = least_budget(command)
        flags = ["--no-verify"] if budget == "no-verify" else [] if budget is None else ["--max-memory", str(budget)]
        evict(src)
        result = run([*command, *flags])
        shutil.rmtree(dst)
        to = f" --dtype {dtype}" if dtype else ""
        if budget == "no-verify":
            rows.append(Row(f"convert{to} --no-verify", result))
            continue
        within = re.search(r"verifying within (\S+ \S+)", result.out)
        exact = "bit-identical after every layer" in result.out
        placements = re.findall(r"verifying: (?:SRC|DST) ran with (.*)", result.out)
        name = f"convert{to}, verify within {format_size(budget) if budget else f'free memory ({within[1]})'}"
        name += " (the least)" if least else ""
        sides = "; ".join(f"{side}: {p.replace(' of weights', '').replace(' as it ran', '')}"
                          for side, p in zip(("SRC", "DST"), placements))
        rows.append(Row(name, result, f"{'bit-identical' if exact else 'NOT bit-identical'}; {sides}", budget))
    return rows


def build_tokenizer(folder: Path) -> None:
    """A byte-level BPE trained on the built-in samples, BOS first: ids within any Llama's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from gated_attention.analysis.samples import builtin_samples

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<pad>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s.text for s in builtin_samples(8)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>").save_pretrained(folder)


def analyze_rows(src: Path, scratch: Path, budgets: list[int | None], dtype: str | None = None) -> list[Row]:
    """`analyze` (the built-in samples, one per domain) at each budget in bf16 and in the default dtype (fp32), and
    at 8x the length in bf16 within the first."""
    tokenizer = scratch / "tokenizer"
    subprocess.run([sys.executable, __file__, "--build-tokenizer", str(tokenizer)], check=True)
    rows = []
    # Inputs 8x as long need more room to run (`analysis.loading.running_memory`): the first budget twice over.
    runs = [(b, 128, dtype) for b in budgets for dtype in ("bfloat16", None)]
    runs += [(budgets[0] and 2 * budgets[0], 1024, "bfloat16")] if budgets[0] != "least" else []
    for budget, length, dtype in runs:
        out = scratch / "analysis"
        command = [sys.executable, "-m", "gated_attention", "analyze", str(src), "--out", str(out), "--tokenizer",
                   str(tokenizer), "--device", "cpu", "--n-per-domain", "1", "--max-length", str(length),
                   "--bootstrap", "100", *([] if dtype is None else ["--dtype", dtype])]  # fmt: skip
        least = budget == "least"
        if least:
            budget = least_budget(command)
        evict(src)
        result = run([*command, *([] if budget is None else ["--max-memory", str(budget)])])
        shutil.rmtree(out)
        placed = re.search(r": (all .* of weights on .*|.* of weights read from the checkpoint as it runs)", result.out)
        within = format_size(budget) if budget else "free memory"
        note = (placed[1].split("; budget")[0] if placed else "") + f"; 3 inputs of {length} tokens"
        within += " (the least)" if least else ""
        rows.append(Row(f"analyze {'bf16' if dtype else 'fp32 (default)'}, within {within}, T={length}", result, note, budget))
    return rows


# Each part of the table: (SRC folder, scratch folder, budgets, convert's --dtype) -> rows.
PARTS: dict[str, Callable[[Path, Path, list[int | None], str | None], list[Row]]] = {
    "convert": convert_rows, "analyze": analyze_rows}


def budget_or_none(text: str) -> int | str | None:
    return None if text == "none" else text if text == "least" else memory_size(text)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.85b", help="the Llama's shapes (default: 0.85b)")
    parser.add_argument("--budgets", nargs="+", type=budget_or_none, default=[10**9, 4 * 10**9, None], metavar="SIZE",
                        help="--max-memory values, e.g. 1GB 4GB; none: the default, what is free; least: the smallest "
                        "each command accepts (default: 1GB 4GB none)")
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS), help="what to measure")
    parser.add_argument("--src-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype SRC is stored in (default: bfloat16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="convert's --dtype (default: none, SRC's own); analyze chooses its own dtypes")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the scratch space is (SRC, DST: 2.1x SRC)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--build-only", nargs=3, metavar=("DIR", "SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--build-tokenizer", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_only:
        build_checkpoint(Path(args.build_only[0]), args.build_only[1], args.build_only[2])
        return 0
    if args.build_tokenizer:
        build_tokenizer(Path(args.build_tokenizer))
        return 0

    root = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=args.workdir))
    try:
        src = root / "src"
        src.mkdir()
        started = time.perf_counter()
        # Built in a child process: a child's peak RSS counts the memory of the process it was forked from,
        # so this process stays small (it imports no torch).
        subprocess.run([sys.executable, __file__, "--build-only", str(src), args.shape, args.src_dtype], check=True)
        shards = sorted(src.glob("*.safetensors"))
        size = sum(p.stat().st_size for p in shards)
        params = size / (4 if args.src_dtype == "float32" else 2)
        stored = "fp32" if args.src_dtype == "float32" else "bf16"
        print(f"SRC: {args.shape}-shaped {stored} Llama, {params / 1e9:.2f}B parameters, {format_size(size)} in {len(shards)} "
              f"shard(s) (built in {time.perf_counter() - started:.0f} s); {os.cpu_count()} CPUs, "
              f"{format_size(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} of RAM")

        evict(src)
        read_once = run([sys.executable, "-c", READ_ONCE, *map(str, shards)])
        imports = run([sys.executable, "-c", IMPORTS_CONVERT])
        rows = [Row("read SRC once (the disk's limit)", read_once, f"{size / read_once.wall_s / 1e9:.2f} GB/s"),
                Row("import only (convert)", imports)]  # fmt: skip
        for part in args.parts:
            rows += PARTS[part](src, root, args.budgets, args.dtype)

        print(f"\n{'command':<48}{'wall s':>8}{'peak RSS':>12}{'above imports':>15}{'within budget':>15}  note")
        for row in rows:
            above = format_size(max(row.run.peak_rss - imports.peak_rss, 0)) if row.run is not imports else ""
            within = "" if row.budget is None else "yes" if row.run.peak_rss <= row.budget else "NO"
            print(f"{row.name:<48}{row.run.wall_s:>8.1f}{format_size(row.run.peak_rss):>12}{above:>15}{within:>15}  {row.note}")
        if over := [row.name for row in rows if row.budget is not None and row.run.peak_rss > row.budget]:
            print(f"peak RSS above --max-memory: {', '.join(over)}")
        converts = [r for r in rows if r.name.startswith("convert")] or [r for r in rows if r.name.startswith("analyze")]
        print(f"\nwall time / one read of SRC: " + ", ".join(f"{r.name.removeprefix('convert, ')} {r.run.wall_s / read_once.wall_s:.1f}x"
                                                            for r in converts))
        print(f"peak RSS / SRC size: " + ", ".join(f"{r.name.removeprefix('convert, ')} {r.run.peak_rss / size:.2f}x" for r in converts))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
