"""The paper's own code builds tiny models of each of its layouts and saves them with their reference outputs.

    KEEP_VENV=~/venvs/tf451 bash tests/with_transformers.sh "transformers==4.51.3" \
        --python tests/paper_reference.py PAPER_CODE_DIR tests/data/paper_layouts

PAPER_CODE_DIR holds `configuration_qwen3.py` and `modeling_qwen3.py` from the
paper's repository (qiuzh20/gated_attention, MIT). They are imported from there
as a package of their own, never copied. Their code runs on the transformers
4.5x releases it was written for (4.51.3 with torch 2.13 here); on transformers 5
it fails while building its config, hence the throwaway venv.

For each layout in `LAYOUTS` (elementwise, headwise, baseline; group sizes 1, 2
and MQA; q/k norm off; bias on) OUT/<layout>/ gets:
- `config.json` and `model.safetensors`: the model as their `save_pretrained`
  writes it, bf16 as the released models, with an `auto_map` naming their two
  files (which are not copied: a reader must never need them);
- `reference.safetensors`: `input_ids` [2, T]; `logits` [2, T, V] (fp32, SDPA,
  their default); `attentions` [L, 2, H, T, T] (fp32, eager); `prompt` [1, P] and
  `greedy` [1, N], their `generate(do_sample=False)`.
OUT/manifest.json records the layouts, the releases and the paper code's commit.

The weights are drawn at random with a spread that makes the outputs worth
comparing (attention far from uniform, gate scores across (0, 1), non-zero
biases, norm weights away from 1): their own init (std 0.02, zero biases, unit
norms) would hide a misplaced bias or a swapped norm. Everything is seeded, so
a rerun on the same releases writes the same bytes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import sys
import types
from pathlib import Path

import torch

SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             head_dim=8, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6)
FLAGS = dict(elementwise_attn_output_gate=False, headwise_attn_output_gate=False, use_qk_norm=True, qkv_bias=False)

# name -> (key/value heads with 4 query heads, flags)
LAYOUTS = {
    "elementwise-mha": (4, dict(elementwise_attn_output_gate=True)),
    "elementwise-gqa2": (2, dict(elementwise_attn_output_gate=True)),
    "elementwise-mqa": (1, dict(elementwise_attn_output_gate=True)),
    "headwise-mha": (4, dict(headwise_attn_output_gate=True)),
    "headwise-gqa2": (2, dict(headwise_attn_output_gate=True)),
    "headwise-mqa": (1, dict(headwise_attn_output_gate=True)),
    "baseline": (2, {}),
    "elementwise-no-qk-norm": (2, dict(elementwise_attn_output_gate=True, use_qk_norm=False)),
    "headwise-bias": (2, dict(headwise_attn_output_gate=True, qkv_bias=True)),
}
TOKENS = 12  # per input
PROMPT, NEW_TOKENS = 6, 8


def import_paper_code(folder: Path):
    """Their two files as the modules of a package `paper_code`, so that `from .configuration_qwen3 import`
    in their modeling file resolves; nothing is copied."""
    for name in ("configuration_qwen3.py", "modeling_qwen3.py"):
        if not (folder / name).is_file():
            sys.exit(f"{folder} has no {name}: give the folder of the paper's repository that holds it")
    package = types.ModuleType("paper_code")
    package.__path__ = [str(folder)]
    sys.modules["paper_code"] = package
    return (importlib.import_module("paper_code.configuration_qwen3"),
            importlib.import_module("paper_code.modeling_qwen3"))


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)


@torch.no_grad()
def reference_outputs(modeling, folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """Their model loaded back from `folder` in fp32 (the bf16 weights, widened exactly), run on fixed ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, TOKENS), generator=g)
    sdpa = modeling.Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    eager = modeling.Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    logits = sdpa(ids).logits
    out = eager(ids, output_attentions=True)
    print(f"  max |logits(sdpa) - logits(eager)| = {(logits - out.logits).abs().max().item():.3g}")
    prompt = ids[:1, :PROMPT].clone()
    greedy = sdpa.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)[:, PROMPT:]
    return {"input_ids": ids, "logits": logits.contiguous(), "attentions": torch.stack(out.attentions).contiguous(),
            "prompt": prompt.contiguous(), "greedy": greedy.contiguous()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paper_code", type=Path, help="folder with the paper's configuration_qwen3.py and modeling_qwen3.py")
    parser.add_argument("out", type=Path, help="output folder (replaced)")
    args = parser.parse_args()

    import transformers
    from safetensors.torch import save_file

    configuration, modeling = import_paper_code(args.paper_code.resolve())
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    for seed, (name, (kv_heads, flags)) in enumerate(LAYOUTS.items()):
        print(f"{name}: {kv_heads} key/value heads, {flags or 'no gate'}")
        torch.manual_seed(seed)
        config = configuration.Qwen3Config(**SHAPE, num_key_value_heads=kv_heads, **{**FLAGS, **flags})
        model = modeling.Qwen3ForCausalLM(config)
        randomize(model, seed)
        # As a Hub repo that ships their code would say; the files themselves are not copied.
        model.config.auto_map = {"AutoConfig": "configuration_qwen3.Qwen3Config",
                                 "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"}
        folder = args.out / name
        model.to(torch.bfloat16).save_pretrained(folder)
        (folder / "generation_config.json").unlink(missing_ok=True)  # nothing of it is read
        save_file(reference_outputs(modeling, folder, seed), str(folder / "reference.safetensors"))

    commit = args.paper_code / "COMMIT"
    manifest = {
        "made_by": "tests/paper_reference.py",
        "paper_code": "qiuzh20/gated_attention (MIT): configuration_qwen3.py, modeling_qwen3.py",
        "paper_code_commit": commit.read_text().strip() if commit.is_file() else None,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "layouts": {name: {"num_key_value_heads": kv, **FLAGS, **flags} for name, (kv, flags) in LAYOUTS.items()},
        "reference": {"tokens": TOKENS, "prompt": PROMPT, "new_tokens": NEW_TOKENS},
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
