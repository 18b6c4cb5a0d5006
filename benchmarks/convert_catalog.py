"""Every causal LM the installed transformers ships, converted: exact, refused in one line, or not built.

For each model type in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` this builds the tiny random model
`benchmarks/analyze_catalog.py` builds (its `build`: the type's default config, shrunk), saves it, and runs
`convert_checkpoint` on it, as `gated-attention convert SRC DST` does (a family of this package's where one
reads the type, else by declaration):

- a `ConversionError` is what `convert` says in one line (exit 2, nothing written): "refused";
- a conversion that verifies (SRC and DST on a fixed prompt, the same bits after every layer and in the
  logits) is then loaded through the package with its gates set to random values: its logits must move (the
  gate is live); then, once every type has run, one fresh interpreter in which `gated_attention` cannot be
  imported loads every exact DST with `trust_remote_code=True` and must get its logits bit for bit:
  "exact" when all three hold;
- anything else (a traceback `convert` would show, a dead gate, a remote-code load that fails) is flagged.

Latent attention (MLA, `HEADWISE`) is converted with `--gate headwise`, the gate it takes (absorbed inference folds
each head's value up-projection into the output projection, which a per-head score commutes with); every other type
with the default elementwise gate.

Each outcome is printed against its expected class (`EXPECTED_*`); a model type with no expectation (a new
transformers release) is flagged NEW, an outcome that differs UNEXPECTED (exit status 1). `--markdown PATH`
writes the table (docs/convert_catalog.md).

    nice python benchmarks/convert_catalog.py                   # every type, ~15 minutes on 2 cores
    python benchmarks/convert_catalog.py gemma2 olmo2           # some types
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import analyze_catalog
from analyze_catalog import EXPECTED_NOT_BUILT, build, first_line


def shrink(d: dict, layers: int = 2) -> dict:
    """`analyze_catalog.shrink`, and a vocabulary no larger than the per-layer inputs' where it caps those to its
    tokenizer's ids (Gemma 4's): the conversion's fixed prompt draws from the whole vocabulary, as a released
    model, whose two are one size, allows."""
    out = _shrink(d, layers)
    per_layer, vocab = out.get("vocab_size_per_layer_input"), out.get("vocab_size")
    if isinstance(per_layer, int) and per_layer > 0 and isinstance(vocab, int) and vocab > per_layer:
        out["vocab_size"] = per_layer
    return out


_shrink, analyze_catalog.shrink = analyze_catalog.shrink, shrink  # `build` (and shrink itself, for sub-configs) call it

EXPECTED_FOR = "5.25"
EXACT = "exact"
# The expected outcome of every causal-LM type of transformers 5.25, from this script's runs (benchmarks/RESULTS.md).
# "refused": words its one line must hold. A type in neither set is expected to be exact.
# Latent attention (MLA): converted with a headwise gate (an elementwise one is refused, `attention_sites.LATENT_FIELDS`).
HEADWISE = set("""
    axk1 axk2 bailing_hybrid deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 dots3_note dots3_note_text glm4_moe_lite
    glm_moe_dsa hy_v4 kimi_linear longcat_flash minicpm3 sarvam_mla youtu
""".split())
EXPECTED_REFUSED: dict[str, str] = {
    # DeepSeek-V4's output projection is two maps, grouped per head block then mixed (o_a_proj, o_b_proj)
    'deepseek_v4': 'holds no output projection',
    # the projection is not the attention module's child (BERT's SelfOutput) or there is none (JetMoe, XLNet)
    'bert': 'holds no output projection',
    'bert-generation': 'holds no output projection',
    'big_bird': 'holds no output projection',
    'camembert': 'holds no output projection',
    'cpmant': 'holds no output projection',
    'data2vec-text': 'holds no output projection',
    'electra': 'holds no output projection',
    'ernie': 'holds no output projection',
    'git': 'holds no output projection',
    'jetmoe': 'holds no output projection',
    'megatron-bert': 'holds no output projection',
    'rembert': 'holds no output projection',
    'roberta': 'holds no output projection',
    'roberta-prelayernorm': 'holds no output projection',
    'roc_bert': 'holds no output projection',
    'roformer': 'holds no output projection',
    'xlm-roberta': 'holds no output projection',
    'xlm-roberta-xl': 'holds no output projection',
    'xlnet': 'holds no output projection',
    'xmod': 'holds no output projection',
    # The verification's own refusal. BigBird-Pegasus: transformers saves this tiny model without its lm_head and loads
    # it back random (tie_word_embeddings, but nothing ties it), SRC included. MiniMax-M3's text model: its experts'
    # sums round differently on the same weights read at other file offsets (3.7e-7 in transformers' own class with
    # a 12-byte tensor put first).
    'bigbird_pegasus': 'exact conversion changed the outputs',
    'minimax_m3_vl_text': 'exact conversion changed the outputs',
    # ProphetNet's attention runs its main and n-gram streams in one call, the gate's input the main stream's alone
    'prophetnet': 'does not run the fixed prompt',
    # no attention: transformers' attention-free models
    'falcon_mamba': 'declares no attention modules',
    'mamba': 'declares no attention modules',
    'mamba2': 'declares no attention modules',
    'rwkv': 'declares no attention modules',
    'xlm': 'declares no attention modules',
    'xlstm': 'declares no attention modules',
    # recorded_outputs.REFUSED, the list `analyze` refuses from too
    'blt': 'patches its entropy model cuts the bytes into',
    'reformer': 'per chunk and hash bucket',
    'gemma4_assistant': 'speculative-decoding assistant',
    'gemma4_unified_assistant': 'speculative-decoding assistant',
    'musicgen': 'audio codec codes',
    'musicgen_melody': 'audio codec codes',
    # a gate of their own on the attention output: no second one
    'laguna': 'gates its attention output already',
    'lfm3': 'gates its attention output already',
    'qwen3_5': 'gates its attention output already',
    'qwen3_5_moe': 'gates its attention output already',
    'qwen3_5_moe_text': 'gates its attention output already',
    'qwen3_5_text': 'gates its attention output already',
    'qwen3_next': 'gates its attention output already',
    'dots3_note': 'gates its attention output already',
    'dots3_note_text': 'gates its attention output already',
    'inkling2_loop_text': 'gates its attention output already',
    'inkling2_text': 'gates its attention output already',
    'hy_v4': 'gates its attention output already',
    'afmoe': 'gates its attention output already',
    'bailing_hybrid': 'gates its attention output already',
    'hrm_text': 'gates its attention output already',
    'minicpm5_moe': 'gates its attention output already',
    'qwen4_exp': 'gates its attention output already',
    'qwen4_exp_text': 'gates its attention output already',
    # gated in a form `analyze` reads no scores of (`gate_sites.UNREAD_OUTPUT_GATES`): refused all the same
    'axk2': 'gates its attention output already',
    'beam': 'gates its attention output already',
    'dory': 'gates its attention output already',
    # a custom output projection (Moshi)
    'moshi': 'not one linear map',
}
EXPECTED_EXACT = set("""
    apertus apertus1p5_text arcee aria_text bamba bart biogpt bitnet blenderbot blenderbot-small codegen
    cohere cohere2 cohere2_moe cohere_compass_text ctrl cwm dbrx diffllama doge dots1 emu3 ergo ernie4_5
    ernie4_5_moe exaone exaone4 exaone_moe falcon_h1 flex_olmo flint fuyu gemma gemma2 gemma3 gemma3_text
    gemma3n_text gemma4 gemma4_text gemma4_unified gemma4_unified_text glm glm4 glm4_moe got_ocr2 gpt-sw3 gpt2
    gpt_bigcode gpt_neox gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoehybrid
    granitemoeshared helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax inkling_text internlm3
    iquestcoder jais2 jamba kolibri1 kolibri1_1 lara_mini lfm2 lfm2_moe llama llama4 llama4_text marian
    mbart mellum mimo_v2_flash minimax minimax_m2 ministral ministral3 mistral mixtral mllama
    modernbert-decoder moss_transcribe_diarize nanochat nemotron nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe opt
    param2moe pegasus persimmon phi phi3 phi4_multimodal phimoe plbart qwen2 qwen2_moe qwen3
    qwen3_moe recurrent_gemma sarvam_moe seed_oss smollm3
    solar_open stablelm starcoder2 vaultgemma whisper xglm zamba zamba2 zaya
    bloom falcon gpt_neo gpt_neox_japanese mpt mvp openai-gpt trocr
    axk1 deepseek_v2 deepseek_v3 deepseek_v32 glm4_moe_lite glm_moe_dsa kimi_linear
    longcat_flash minicpm3 sarvam_mla youtu
""".split())
NOT_BUILT = EXPECTED_NOT_BUILT  # the tiny-config rules' own limit (analyze_catalog.py says which and why)


def outcome(model_type: str, work: Path) -> tuple[str, str, dict | None]:
    """(class, detail, what the remote-code check needs or None): exact (so far: before the remote-code check) /
    refused / dead gate / error / build failed."""
    import torch
    from transformers import AutoModelForCausalLM

    from gated_attention.convert.convert import convert_checkpoint
    from gated_attention.convert.errors import ConversionError
    from gated_attention.convert.verify import verification_ids

    try:
        model = build(model_type)
        model.save_pretrained(work / "src")
    except Exception as e:  # noqa: BLE001 - the catalog's own limit, reported as such
        return "build failed", first_line(e), None
    del model
    lines: list[str] = []
    try:
        convert_checkpoint(str(work / "src"), work / "dst", gate="headwise" if model_type in HEADWISE else None,
                           log=lines.append)
    except ConversionError as e:  # what `convert` says in one line, exit 2
        return "refused", str(e).splitlines()[0], None
    except Exception as e:  # noqa: BLE001 - a traceback `convert` would show
        return "error", first_line(e), None
    finally:
        shutil.rmtree(work / "src", ignore_errors=True)
    route = next((line for line in lines if line.startswith("converting ")), "")
    how = route.split(" by declaration, ")[1].split(" (gate ")[0] if " by declaration, " in route else "a family of ours"
    model = AutoModelForCausalLM.from_pretrained(work / "dst").eval()
    text = model.config.get_text_config()
    ids = verification_ids(text.vocab_size, getattr(text, "max_position_embeddings", None) or 32)
    gates = [p for name, p in model.named_parameters() if ".attn_gate." in name]
    with torch.no_grad():
        logits = model(ids).logits
        for p in gates:
            p.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        moved = (model(ids).logits - logits).abs().max().item()
    if not moved > 0:
        return "dead gate", f"{how}: random gates leave the logits as they were", None
    how += " (headwise gate)" if model_type in HEADWISE else ""
    return EXACT, f"{how}; random gates move the logits by up to {moved:.2g}", {"ids": ids, "logits": logits}


def remote_code_check(expected: dict[str, dict], work: Path) -> dict[str, str]:
    """Load every DST in `expected` (folder -> ids, logits) in a fresh interpreter without the package; returns the
    folders that fail, each with its one line."""
    import torch

    torch.save(expected, work / "expected.pt")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["gated_attention"] = None
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
        logging.set_verbosity_error()
        for folder, run in torch.load({str(work / "expected.pt")!r}).items():
            try:
                model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
                with torch.no_grad():
                    logits = model(run["ids"]).logits
                diff = (logits - run["logits"]).abs().max().item()
                close = torch.allclose(logits, run["logits"], rtol=1e-5, atol=1e-6)
                print(folder, "ok" if torch.equal(logits, run["logits"]) else f"ok within {{diff:.1g}}" if close
                      else f"differs by up to {{diff:.2g}}", flush=True)
            except Exception as e:
                print(folder, "failed", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True)  # fmt: skip
    results = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.strip())
    return {folder: results.get(folder, f"no answer ({first_stderr(proc.stderr)})") for folder in expected}


def first_stderr(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def expected(model_type: str) -> str | None:
    if model_type in EXPECTED_REFUSED:
        return "refused"
    if model_type in NOT_BUILT:
        return "build failed"
    if model_type in EXPECTED_EXACT:
        return EXACT
    return None


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*", help="model types (default: all)")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    args = p.parse_args(argv)
    from transformers.utils import logging

    import gated_attention  # noqa: F401 - registers the declared types, as the command does

    logging.set_verbosity_error()
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows, checks, start = {}, {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="convert-catalog-") as tmp:
        for model_type in types:
            t0 = time.perf_counter()
            work = Path(tmp) / model_type
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                kind, detail, check = outcome(model_type, work)
            if check is not None:
                checks[str(work / "dst")] = check
            else:
                shutil.rmtree(work, ignore_errors=True)
            rows[model_type] = [kind, detail]
            print(f"{model_type:<28} {kind:<14} {detail}  ({time.perf_counter() - t0:.1f}s)", flush=True)
        print(f"loading {len(checks)} converted models as remote code, without the package", flush=True)
        for folder, answer in remote_code_check(checks, Path(tmp)).items():
            model_type = Path(folder).parent.name
            if answer == "ok":
                continue
            if answer.startswith("ok within"):  # the same code on weights read again: rounding of the reading's own
                rows[model_type][1] += f"; as remote code, logits {answer.removeprefix('ok ')}"
                continue
            rows[model_type] = ["remote code fails", f"{rows[model_type][1]}; without the package: {answer}"]
            print(f"{model_type:<28} remote code fails: {answer}", flush=True)
    total = time.perf_counter() - start
    table, counts = [], {}
    for model_type, (kind, detail) in rows.items():
        want = expected(model_type)
        flag = ("NEW" if want is None
                else "UNEXPECTED" if kind != want or (kind == "refused" and EXPECTED_REFUSED[model_type] not in detail)
                else "")  # fmt: skip
        if flag:
            print(f"{model_type}: {kind} ({flag}, expected {want})")
        table.append((model_type, kind, flag, detail))
        counts[kind] = counts.get(kind, 0) + 1
    print(f"\n{len(rows)} model types in {total:.0f} s: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    flagged = [r for r in table if r[2]]
    print(f"flagged: {len(flagged)} ({', '.join(r[0] for r in flagged) or 'none'})")
    if args.markdown:
        write_markdown(args.markdown, table, counts, total)
    return 1 if any(r[2] == "UNEXPECTED" for r in table) else 0


def write_markdown(path: str, table, counts, seconds: float) -> None:
    import transformers

    words = {EXACT: "exact (the same bits after every layer, live gates, loads as remote code)",
             "refused": "refused in one line (exit 2, nothing written)",
             "build failed": "not built by the catalog (its tiny-config rules; not converted)"}
    lines = [
        "# `convert` on every causal LM transformers ships",
        "",
        f"Written by `python benchmarks/convert_catalog.py --markdown docs/convert_catalog.md` with transformers "
        f"{transformers.__version__} ({len(table)} model types of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {seconds:.0f} s "
        "on 2 CPU cores). Each type is the tiny random model `benchmarks/analyze_catalog.py` builds, saved and "
        "converted with `--init exact` and verification (latent attention, MLA, with `--gate headwise`, the gate it takes); \"exact\" means the conversion verified bit-identical "
        "hidden states after every layer and logits, random gates then move the logits (the gate is live), and "
        "DST loads without the package (`trust_remote_code=True`) with the same logits (see the script's "
        "docstring). The families this package has classes for (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, "
        "Mixtral, Phi-3) are converted onto them; every other type by declaration, in its own transformers "
        "class ([models.md](models.md)).",
        "",
        *(f"- {words.get(kind, kind)}: {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])),
        "",
        "| model type | outcome | detail |",
        "|---|---|---|",
    ]
    for model_type, kind, flag, detail in table:
        lines.append(f"| `{model_type}` | {kind}{' (' + flag + ')' if flag else ''} | {detail.replace('|', '/')} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
