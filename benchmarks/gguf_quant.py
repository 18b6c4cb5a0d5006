"""GGUF quant types of the hybrid's native export: llama.cpp's own quantizer, and its perplexity against its f32.

    python benchmarks/gguf_quant.py                          # Q8_0 and Q4_K_M, the hybrid trained 200 steps
    python benchmarks/gguf_quant.py --types Q8_0 Q4_K_M Q6_K --steps 0   # random weights instead

The model is serving_check's `hybrid-native` shape (a Gated DeltaNet hybrid of 4
layers, three GDN then attention, width 256, GDN head dim 128, attention heads
of 64, the embedded corpus's 512-token BPE tokenizer), trained `--steps` steps
on the embedded corpus's training split (`--steps 0`: random weights with its
gates and norms randomized, as serving_check builds it). Every matrix's input
is 256 wide (the width, the MLP's 256, the heads' 4 x 64 and 2 x 128), the
block of the K quants, so no tensor falls back for its shape (llama.cpp's
quantize warnings, if any, are printed).

It is exported with `export --format qwen3_5`, converted to GGUF f32 by
llama.cpp's converter through `examples/convert_to_gguf.py`, and quantized by
`llama_model_quantize` (llama-quantize's own function, default parameters, no
importance matrix) in llama-cpp-python's environment. Each GGUF then gives
every position's logits (`logits_all`) on `--sequences` validation sequences
of `--seq-len` tokens (BOS first), fed as token ids, so every model reads the
same tokens; transformers gives the export's logits on the same ids in fp32.

One table: per model, the file size, its ratio to the f32 GGUF's, the
perplexity of the sequences' next tokens, its change from the f32 GGUF's, the
mean KL(f32 GGUF || model) of the next-token distributions (nats) and the
fraction of positions whose most likely token is the f32 GGUF's. The
transformers row is the anchor: it shows the f32 GGUF computes what
transformers does. Then, per quant type, the GGUF's tensors counted by storage
type, read back from the file. The perplexity is computed here from llama.cpp's
logits over the whole of each sequence; llama.cpp's `llama-perplexity` tool
scores only the second half of each window, so its figures would differ.

llama.cpp is found as serving_check finds it (`--llama-cpp-python`,
`--gguf-converter`, or `$GATED_ATTENTION_LLAMA_CPP_PYTHON`,
`$GATED_ATTENTION_GGUF_CONVERTER`); where it is not found the script says so in
one line and exits 0. Files go to `--work` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # serving_check, whose engine finding, GGUF conversion and engine runner this reuses

import serving_check  # noqa: E402

from gated_attention.cli_common import OneLineErrorParser, bounded  # noqa: E402
from gated_attention.recipes.report import format_columns  # noqa: E402

# llama.cpp's file types this offers (`LLAMA_FTYPE_MOSTLY_<name>` in llama-cpp-python); each takes the shape
# of this model (every matrix input a multiple of 256).
TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "Q2_K")
DEFAULT_TYPES = ("Q8_0", "Q4_K_M")
BATCH_SIZE, LR = 8, 2e-3  # a brief run: a higher rate than quickstart's 1e-3 gets further in few steps
MAX_POSITIONS = 256


# ---------------------------------------------------------------------------------------------
# The model


def hybrid_export(work: Path, steps: int, seq_len: int, n_sequences: int, log):
    """(the export's folder, validation rows `[n, seq_len]`): serving_check's hybrid shape, trained or random."""
    import gated_attention as ga
    from gated_attention.convert.export import export_checkpoint
    from gated_attention.training import TrainConfig, data, make_optimizer, make_scheduler, train

    tokenizer = data.load_tokenizer(512, 200_000)
    bos = tokenizer.bos_token_id
    valid = data.spread_rows(data.pack(data.corpus_tokens(tokenizer, "validation", 200_000), seq_len, bos), n_sequences)
    special = dict(vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = ga.GatedDeltaNetHybridForCausalLM(serving_check.hybrid_config(special, hybrid_ratio=4))
    if steps:
        rows = data.pack(data.corpus_tokens(tokenizer, "train", 200_000), seq_len, bos)
        log(f"training the hybrid: {steps} steps of {BATCH_SIZE} x {seq_len} tokens, AdamW lr {LR}")
        t0 = time.perf_counter()
        train_config = TrainConfig(steps=steps, batch_size=BATCH_SIZE, lr=LR, gate_lr=LR,
                                   warmup_steps=max(1, steps // 10))
        optimizer = make_optimizer(model, train_config.lr, train_config.gate_lr, train_config.weight_decay)
        scheduler = make_scheduler(optimizer, train_config.steps, train_config.warmup_steps)
        history = train(model, rows, train_config, optimizer, scheduler, progress=False)
        log(f"trained in {(time.perf_counter() - t0) / 60:.1f} min, last loss {history[-1]['loss']:.3f}")
    else:
        log("the hybrid has random weights, its gates and norms randomized as serving_check's")
        serving_check.randomize_hybrid(model)
    model.eval()
    source = work / "hybrid"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    with warnings.catch_warnings():  # what mlx-lm cannot run is no concern here
        warnings.simplefilter("ignore", ga.GatedAttentionWarning)
        export_checkpoint(str(source), work / "hybrid-native", overwrite=True, log=lambda msg: None)
    return work / "hybrid-native", valid


@torch.no_grad()
def transformers_logits(folder: Path, rows: torch.Tensor) -> torch.Tensor:
    """The export's logits `[N, T, V]` in fp32, as transformers' Qwen3.5 computes them on the CPU."""
    from transformers import AutoModelForCausalLM

    from gated_attention.convert.export import qwen3_5_torch_path

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with qwen3_5_torch_path():
        return torch.cat([model(input_ids=row[None]).logits.float() for row in rows])


# ---------------------------------------------------------------------------------------------
# Measures


def scores(logits: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor) -> dict:
    """Perplexity of `rows`' next tokens under `logits` `[N, T, V]`, and KL(reference || logits) and top-1
    agreement with `reference` over the same N x (T - 1) predictions (float64: a KL near 1e-10 survives)."""
    logp = logits[:, :-1].double().log_softmax(-1)  # [N, T-1, V]
    ref = reference[:, :-1].double().log_softmax(-1)
    nll = -logp.gather(-1, rows[:, 1:, None]).squeeze(-1)  # [N, T-1]
    kl = (ref.exp() * (ref - logp)).sum(-1)  # [N, T-1]
    return {"perplexity": float(nll.mean().exp()), "kl": float(kl.mean()),
            "top1": float((logp.argmax(-1) == ref.argmax(-1)).double().mean()), "predictions": nll.numel()}


def tensor_types(path: Path, converter: str) -> dict[str, dict]:
    """storage type -> {"tensors": how many of the GGUF's tensors, "names": their names with the layer number
    folded (`blk.*.ssm_a`: in some layer)}, read with llama.cpp's gguf-py from the converter's source tree."""
    sys.path.insert(0, str(Path(converter).parent / "gguf-py"))
    from gguf import GGUFReader

    out: dict[str, list[str]] = {}
    for t in GGUFReader(str(path)).tensors:
        out.setdefault(t.tensor_type.name, []).append(".".join("*" if p.isdigit() else p for p in t.name.split(".")))
    return {k: {"tensors": len(v), "names": sorted(set(v))} for k, v in sorted(out.items())}


def format_table(rows: list[dict]) -> str:
    columns = [("type", "type", "{}"), ("mb", "file MB", "{:.2f}"), ("ratio", "ratio to f32", "{:.3f}"),
               ("perplexity", "perplexity", "{:.3f}"), ("change", "change vs f32", "{:+.2%}"),
               ("kl", "KL vs f32", "{:.3g}"), ("top1", "top-1 agreement", "{:.4f}")]
    return format_columns([{**r, "mb": r["bytes"] / 1e6} for r in rows], columns)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrorParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="+", choices=TYPES, default=list(DEFAULT_TYPES),
                   help="llama.cpp quant types (default: %(default)s)")
    p.add_argument("--steps", type=bounded(int, 0), default=200,
                   help="training steps on the embedded corpus; 0: random weights (default: %(default)s)")
    p.add_argument("--sequences", type=bounded(int, 1), default=16, help="validation sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=bounded(int, 2, high=MAX_POSITIONS + 1), default=128,
                   help="tokens per sequence, BOS included (default: %(default)s)")
    p.add_argument("--threads", type=bounded(int, 1), help="llama.cpp's and torch's threads (default: their own)")
    p.add_argument("--work", type=Path, help="where the checkpoints and GGUF files go (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the rows and tensor types as JSON")
    p.add_argument("--llama-cpp-python")
    p.add_argument("--gguf-converter")
    args = p.parse_args(argv)

    found = serving_check.find_engines(argparse.Namespace(engines=["llama.cpp"], llama_cpp_python=args.llama_cpp_python,
                                                          gguf_converter=args.gguf_converter))
    if "llama.cpp" not in found:
        return 0  # find_engines said what is missing, in one line
    python, converter = found["llama.cpp"]["python"], found["llama.cpp"]["converter"]
    version = serving_check.engine_version(python, "llama_cpp")
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="gguf-quant-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows_out, types_out = run(args, python, converter, work, log)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    if rows_out is None:
        return 1
    import transformers

    weights = f"trained {args.steps} steps" if args.steps else "random"
    print()
    print(f"llama-cpp-python {version}, transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{args.sequences} validation sequences x {args.seq_len} tokens ({rows_out[0]['predictions']} predictions); "
          f"hybrid {weights}; vs f32 = against the f32 GGUF; {(time.perf_counter() - t_start) / 60:.1f} min wall")
    print(format_table(rows_out))
    for name, types in types_out.items():  # the names of every type but the file's commonest
        common = max(types, key=lambda t: types[t]["tensors"])
        print(f"{name} tensors: " + "; ".join(
            f"{t} {v['tensors']}" + ("" if t == common else f" ({', '.join(v['names'])})") for t, v in types.items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows_out, "tensor_types": types_out}, indent=1), encoding="utf-8")
    return 0


def run(args, python: str, converter: str, work: Path, log) -> tuple[list[dict] | None, dict]:
    export, valid = hybrid_export(work, args.steps, args.seq_len, args.sequences, log)
    log(f"converting {export.name} to GGUF f32 with {converter}")
    f32, error = serving_check.to_gguf(serving_check.Checkpoint("hybrid-native", export, []), converter, work)
    if f32 is None:
        print(f"llama.cpp: {error}")
        return None, {}

    ggufs = {"F32": f32}
    jobs = [{"name": t, "path": str(f32), "out": str(f32.with_name(f"hybrid-native-{t}.gguf")), "type": t,
             "threads": args.threads} for t in args.types]
    log(f"quantizing with llama_model_quantize: {', '.join(args.types)}")
    for result in serving_check.run_engine("llama.cpp-quantize", python, jobs, work, log):
        if not result["ok"]:
            print(f"llama.cpp: {result['name']} failed: {result['error']}")
            continue
        ggufs[result["name"]] = Path(next(j["out"] for j in jobs if j["name"] == result["name"]))
        for line in result["warnings"]:
            print(f"llama.cpp quantize {result['name']}: {line}")

    ids = valid.tolist()
    jobs = [{"name": t, "path": str(path), "out": str(work / f"logits-{t}.npy"), "prompts": ids,
             "max_model_len": args.seq_len, "threads": args.threads} for t, path in ggufs.items()]
    log(f"llama.cpp logits of {len(ids)} sequences x {args.seq_len} tokens: {', '.join(ggufs)}")
    logits = {}
    for result in serving_check.run_engine("llama.cpp-logits", python, jobs, work, log):
        if result["ok"]:
            import numpy as np

            logits[result["name"]] = torch.from_numpy(np.load(work / f"logits-{result['name']}.npy"))
        else:
            print(f"llama.cpp: logits of {result['name']} failed: {result['error']}")
    if "F32" not in logits:
        return None, {}

    log("transformers logits of the export, fp32")
    reference = logits["F32"]
    anchor = transformers_logits(export, valid)
    f32_bytes = f32.stat().st_size
    base = scores(reference, reference, valid)
    out = [{"type": "transformers fp32 (export)",
            "bytes": sum(f.stat().st_size for f in export.glob("*.safetensors")), **scores(anchor, reference, valid)}]
    out += [{"type": f"GGUF {t}", "bytes": ggufs[t].stat().st_size, **scores(logits[t], reference, valid)}
            for t in ggufs if t in logits]
    for row in out:
        row["ratio"] = row["bytes"] / f32_bytes
        row["change"] = row["perplexity"] / base["perplexity"] - 1
    return out, {f"GGUF {t}": tensor_types(ggufs[t], converter) for t in ggufs if t in logits}


if __name__ == "__main__":
    sys.exit(main())
