"""The model cards `convert`, `extend` and `export` write beside the weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import __version__
from ..configuration.declared import text_config
from ..hub.model_card import PIN_REVISION, options_rows, write_model_card
from ..hub.provenance import Provenance
from ..quantization.ignore import FUSED_GATE, OWN_GATE, ignore_section
from .plan import GATE_BIAS_INIT
from .quantized import describe as describe_quantization
from .rope import RopeChange


# The Hub's base_model_relation of every checkpoint these commands write (docs/models.md, "Model cards"): the
# base's weights, whole, extended or rearranged into a new full model: neither an adapter, a merge nor a
# quantized copy.
RELATION = "finetune"

QUANTIZATION = ("`gated-attention quantize PATH DST --scheme W8A8` writes a compressed-tensors checkpoint of it, and "
                "`gated-attention analyze PATH --out DIR --quantization W8A8 NVFP4` measures what each format costs "
                "it, gates kept or not. ")


def write_conversion_card(stage, src, family_name, init, dtype_name, rope: RopeChange, config, command: str,
                          gguf: dict | None = None, gate_name: str = "self_attn.attn_gate", output_name: str = "o_proj",
                          quantization: dict | None = None, *, source: Provenance) -> None:
    options = {"source": src}
    changed = []
    if quantization is not None:
        options["quantized source"] = describe_quantization(quantization)
        changed.append(quantized_source_line(quantization, dtype_name))
    if gguf is not None:  # hub.gguf's record of the file the weights were dequantized from
        types = ", ".join(f"{n} {name}" for name, n in gguf["tensor_types"].items())
        options["GGUF"] = f"{gguf['file']} ({gguf['quantization']})"
        changed.append(
            f"- Source: the GGUF file `{gguf['file']}` ({gguf['size']:,} bytes; {gguf['architecture']}, "
            f"{gguf['quantization']}; tensors {types}), dequantized by transformers' GGUF loader. The conversion "
            "is exact against those dequantized weights; the quantization's own error stays as it was."
        )
    if command == "convert" and init == "copy":  # the source's own gate kept, or none (`convert.planned_gate`)
        if config.attn_gate["position"] is None:
            changed.append("- No gate: the source has none and none was asked for; its weights are copied unchanged.")
        else:
            gate = config.attn_gate["granularity"]
            options["gate"] = f"the source's own, {gate}"
            changed.append(
                f"- The source's own sigmoid output gate (G1, {gate}), kept as trained: its rows of the source's "
                "`q_proj` are `self_attn.attn_gate`, the query rows `q_proj`; the numbers are the source's."
            )
    elif command == "convert":
        gate = config.attn_gate["granularity"]  # the gate as the config holds it, never the flag's text
        options.update({"--gate": gate, "--init": init})
        granularity = "one score per channel" if gate == "elementwise" else "one score per head"
        changed.append(
            f"- Every attention layer got a sigmoid output gate (G1, {gate}: {granularity}), "
            f"`{gate_name}`, computed from the same normed hidden states as q/k/v."
        )
        rank, channels = config.attn_gate["rank"], config.attn_gate["input_channels"]
        if rank is not None:
            options["--gate-rank"] = rank
            changed.append(f"- The gate is low-rank: `attn_gate.up(attn_gate.down(x))` through {rank} values; `down` "
                           f"starts as the first {rank} rows of the identity, `up` at 0.")
        if channels is not None:
            options["--gate-input-channels"] = channels
            changed.append(f"- The gate reads only the first {channels} channels of its input.")
        if init == "exact":
            changed.append(
                f"- Exact init: gate weight 0, so every gate score is sigmoid(0) = 0.5 exactly, and `{output_name}` "
                "is doubled (exact in every float format). The logits equal the base model's bit for bit."
            )
        else:
            changed.append(
                f"- Bias init: gate weight 0 and gate bias {GATE_BIAS_INIT:g}, so every score is sigmoid"
                f"({GATE_BIAS_INIT:g}) = {torch.sigmoid(torch.tensor(GATE_BIAS_INIT)).item():.7f}; `{output_name}` unchanged. "
                "Close to the base model, not equal, and the gate's gradient starts tiny (scaled by ~4.5e-5)."
            )
    options["--dtype"] = dtype_name
    if rope.rope_theta is not None:
        options["--rope-theta"] = rope.rope_theta
    if rope.yarn_factor is not None:
        options["--yarn-factor"] = rope.yarn_factor
        options["--original-max-position-embeddings"] = rope.original_max_position_embeddings
    if not rope.empty:
        text = text_config(config)
        changed.append(f"- RoPE: {rope.describe()}; `rope_parameters` = `{json.dumps(text.rope_parameters)}`, "
                       f"`max_position_embeddings` = {text.max_position_embeddings}.")
    if command == "extend":
        changed.append("- Weights are copied unchanged; only the position encoding changed.")
    changed.append("- `config.json` has an `auto_map` and the modeling code sits beside the weights (remote code).")
    title = f"{Path(str(src)).name} with gated attention" if command == "convert" else f"{Path(str(src)).name}, RoPE extended"
    summary = (
        f"A {family_name} checkpoint converted to gated softmax attention (the sigmoid output gate of *Gated "
        "Attention for Large Language Models*)." if command == "convert"
        else "A gated-attention checkpoint with its RoPE changed for a longer context."
    )
    how_to_load = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", revision="COMMIT", trust_remote_code=True)\n'
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO", revision="COMMIT")\n```\n\n'
        f"{PIN_REVISION} With `pip install gated-attention`, `import gated_attention` first and drop `trust_remote_code`."
    )
    continue_pretraining = (
        "The gates start where they do no harm and only help once trained. With the gated-attention "
        "repository's example script (`accelerate launch`, DDP or FSDP configs in `examples/configs/`):\n\n"
        "```bash\naccelerate launch --config_file examples/configs/ddp.yaml examples/continued_pretraining.py \\\n"
        "    --model PATH_OR_REPO --output-dir runs/cpt --text-files data/ \\\n"
        "    --seq-len 2048 --batch-size 4 --grad-accum 8 --steps 2000 --lr 2e-5 --gate-lr 1e-3\n```\n\n"
        "Known trap (official Gated Attention repo, issue #10): converted gates may barely move in continued "
        f"pretraining. Give the gate parameters (`{gate_name if '*' in gate_name else '*.' + gate_name}.*`) their own, "
        "larger learning rate "
        "(`--gate-lr` above) and watch the mean gate score the script logs; it starts at exactly 0.5 "
        "with the exact init. With PEFT, put `attn_gate` in `modules_to_save` (see `examples/lora_finetune.py`)."
    )
    write_model_card(
        stage,
        "converted_model",
        source=source,
        relation=RELATION,
        tags=["gated-attention", "converted" if command == "convert" else "rope-extended"],
        title=title,
        summary=summary,
        options_rows=options_rows(options),
        what_changed="\n".join(changed),
        how_to_load=how_to_load,
        continue_pretraining=continue_pretraining,
        quantization=QUANTIZATION + ignore_section([OWN_GATE], "its `attn_gate` modules"),
        command=f"gated-attention {command}",
        version=__version__,
    )


def quantized_source_line(quantization: dict, dtype_name: str) -> str:
    """The card's line for a quantized source (`quantized.py`): its format, and what the dequantization did."""
    rounding = ("exactly (float32 holds every product of a weight and its scale)" if dtype_name == "float32"
                else f"and rounded once to {dtype_name}")  # fmt: skip
    return (f"- Source: quantized, {describe_quantization(quantization)}; each weight was dequantized as it was read "
            f"{rounding}. The conversion is exact against those dequantized weights; the quantization's own error "
            "stays as it was.")


def write_export_card(stage: Path, src: str, config, layout: str = "text", *, source: Provenance) -> None:
    spec = config.attn_gate
    write_model_card(
        stage,
        "converted_model",
        source=source,
        relation=RELATION,
        tags=["gated-attention", "qwen3_5"],
        title=f"{Path(str(src)).name} in the native Qwen3.5 layout",
        summary="A gated-attention model exported to transformers' own Qwen3.5 text architecture, "
        "so it loads without remote code and runs on engines that support Qwen3.5.",
        options_rows=options_rows({"source": src, "--format": "qwen3_5", "--layout": layout}),
        what_changed="\n".join(
            [
                f"- The attention gate (G1, {spec['granularity']}"
                + (", shared across heads" if spec["head_shared"] else "")
                + ") moved into `q_proj`: per head, D query rows then D gate rows"
                + (" (a per-head score becomes D equal rows)." if spec["granularity"] == "headwise" or spec["head_shared"] else "."),
                "- RMSNorm weights are stored as `w - 1` (Qwen3.5 multiplies by `1 + w`); checked exact for every weight.",
                *(
                    ["- Gated DeltaNet layers: q/k/v projections and convolutions fused into `in_proj_qkv` and `conv1d`; "
                     "`g_proj`, `a_proj`, `b_proj`, `o_norm`, `o_proj` renamed `in_proj_z`, `in_proj_a`, `in_proj_b`, `norm`, `out_proj`."]
                    if "linear_attention" in config.layer_types
                    else []
                ),
                "- `partial_rotary_factor` is 1.0: RoPE rotates the whole head, as in the source.",
                *(
                    ["- The config has the Hub's Qwen3.5 layout for mlx-lm: `model_type` `qwen3_5`, the text model "
                     "under `text_config`. transformers from 5.18 loads the tokenizer of such a folder as "
                     "`Qwen3_5Tokenizer`, whatever was saved."]
                    if layout == "mlx"
                    else []
                ),
                "- In float32 the logits match the source; in bf16 they differ by rounding order only "
                "(Qwen3.5's norms multiply in float32 before rounding).",
            ]
        ),
        how_to_load="```python\nfrom transformers import AutoModelForCausalLM\n\n"
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", revision="COMMIT")  # Qwen3_5ForCausalLM, no '
        "remote code\n```\n\nReplace `COMMIT` with a commit hash of this repo: a pinned commit keeps the weights the "
        "ones you checked, where a branch can change under you.",
        continue_pretraining="Train it like any transformers causal LM. The gate rows are the second half of each "
        "head's block in `q_proj`; give them their own learning rate if they should move faster than the rest.",
        quantization=QUANTIZATION + ignore_section([FUSED_GATE], "the gate is the second half of each head's rows of "
                                                   "`q_proj`, kept by keeping that `q_proj` and the `k_proj` and `v_proj` "
                                                   "engines fuse it with"),
        command="gated-attention export",
        version=__version__,
    )
