"""Does `gated-attention quantize` compute the scales llm-compressor's `oneshot` computes? One tiny G1 model,
each scheme rounded both ways, scales and logits compared.

    python benchmarks/llmcompressor_agreement.py --llmcompressor-python ~/venvs/llmc/bin/python

llm-compressor pins transformers (0.14: 5.15 to 5.17) and compressed-tensors (0.14: 0.19, which lacks the
`allowed_modules` this package's rounding passes), so it runs in its own environment, one that can import
this package (`tests/with_transformers.sh` builds one on top of this one; then `pip install llmcompressor`
there). This side rounds with `quantization.rounding.quantize_in_place` (every linear map but `lm_head`,
min-max scales, static scales from the calibration rows); the other side loads the same saved weights and
runs `oneshot` with `QuantizationModifier(targets="Linear", scheme=S, ignore=["lm_head"])` on the same rows,
through its `basic` pipeline (its default `sequential` pipeline traces the model with torch.fx, which stops
at the decoder's keyword arguments). Printed per scheme: the largest relative difference of each scale
parameter over the linear maps, and the largest logit difference over the calibration rows. Where no
llm-compressor python is given or found, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SCHEMES = ("W8A8", "W4A16", "FP8", "NVFP4")
SCALES = ("weight_scale", "weight_global_scale", "input_scale", "input_global_scale")
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, attn_gate={"position": "G1"})


def _scales(model, paths) -> dict[str, torch.Tensor]:
    return {f"{path}.{name}": getattr(model.get_submodule(path), name).detach().clone()
            for path in paths for name in SCALES if hasattr(model.get_submodule(path), name)}


@torch.no_grad()
def _logits(model, rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(input_ids=ids).logits for ids in rows])


def ours(work: Path, schemes: list[str], rows: int) -> None:
    """The model (random weights of std 0.05, as a trained layer's), its calibration rows, and this package's
    scales and logits per scheme, saved under `work`."""
    import gated_attention as ga
    from gated_attention.quantization.rounding import quantize_in_place
    from gated_attention.quantization.targets import linear_paths

    torch.manual_seed(0)
    model = ga.GatedAttentionForCausalLM(ga.GatedAttentionConfig(**SHAPE)).eval()
    for p in model.parameters():
        if p.dim() == 2:
            p.data.normal_(0, 0.05)
    model.save_pretrained(work / "model")
    ids = [torch.randint(0, SHAPE["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(rows)]
    out = {"ids": ids}
    for scheme in schemes:
        rounded = copy.deepcopy(model)
        paths = list(linear_paths(rounded))
        quantize_in_place(rounded, scheme, paths, ids)
        out[scheme] = {"scales": _scales(rounded, paths), "logits": _logits(rounded, ids)}
    torch.save(out, work / "ours.pt")


def theirs(work: Path, schemes: list[str]) -> None:
    """In llm-compressor's environment: `oneshot` on the saved model, compared with `ours.pt`; prints the table."""
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import gated_attention as ga
    from gated_attention.training import data

    ref = torch.load(work / "ours.pt")
    ids = ref["ids"]
    rows = Dataset.from_dict({"input_ids": [i[0].tolist() for i in ids], "attention_mask": [[1] * i.shape[1] for i in ids]})
    print(f"llm-compressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}, "
          f"transformers {transformers.__version__} (this side: see the line above)")
    print(f"{'scheme':<7} " + " ".join(f"{name:>19}" for name in SCALES) + f" {'max |dlogit|':>13} {'max |logit|':>12}")
    for scheme in schemes:
        model = ga.GatedAttentionForCausalLM.from_pretrained(work / "model").eval()
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, dataset=rows, recipe=recipe, processor=data.load_tokenizer(SHAPE["vocab_size"], 200_000),
                pipeline="basic", num_calibration_samples=len(ids), max_seq_length=ids[0].shape[1])
        worst: dict[str, float | str] = {}
        for key, mine in ref[scheme]["scales"].items():
            path, name = key.rsplit(".", 1)
            other = getattr(model.get_submodule(path), name, None)
            if other is None:
                worst[name] = "missing"
                continue
            diff = ((mine.float() - other.float()).abs().max() / mine.float().abs().max()).item()
            worst[name] = max(float(worst.get(name, 0.0)), diff)
        logits = _logits(model, ids)
        cells = [("-" if name not in worst else worst[name] if isinstance(worst[name], str) else f"{worst[name]:.2g}")
                 for name in SCALES]
        print(f"{scheme:<7} " + " ".join(f"{c:>19}" for c in cells)
              + f" {(logits - ref[scheme]['logits']).abs().max().item():>13.2g} {logits.abs().max().item():>12.3g}")


def main(argv: list[str] | None = None) -> int:
    from gated_attention.cli_common import OneLineErrorParser, bounded

    p = OneLineErrorParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--llmcompressor-python", help="a python with llmcompressor that can import this package "
                   "(default: $GATED_ATTENTION_LLMCOMPRESSOR_PYTHON)")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), metavar="SCHEME", help="(default: %(default)s)")
    p.add_argument("--rows", type=bounded(int, 1), default=4, help="calibration rows of 32 tokens (default: %(default)s)")
    p.add_argument("--theirs", type=Path, help=argparse.SUPPRESS)  # the child's side: the work folder
    args = p.parse_args(argv)
    if args.theirs:
        theirs(args.theirs, args.schemes)
        return 0
    python = args.llmcompressor_python or os.environ.get("GATED_ATTENTION_LLMCOMPRESSOR_PYTHON")
    if not python:
        print("no llm-compressor python given (--llmcompressor-python): nothing to compare")
        return 0
    import compressed_tensors
    import transformers

    with tempfile.TemporaryDirectory(prefix="llmc-agreement-") as work:
        ours(Path(work), args.schemes, args.rows)
        print(f"this package: compressed-tensors {compressed_tensors.__version__}, transformers {transformers.__version__}")
        sys.stdout.flush()
        return subprocess.run([python, __file__, "--theirs", work, "--schemes", *args.schemes]).returncode


if __name__ == "__main__":
    sys.exit(main())
