"""`quantize`: MODEL's linear maps rounded to a compressed-tensors preset, written as the compressed checkpoint
vLLM and transformers load, and checked against the measurement before it appears.

The recipe is compressed-tensors alone, round-to-nearest with min-max scales (`quantization.rounding`): the
arm `all` (`--gates quantize`) or `gates_kept` (`--gates keep`) of `analyze --quantization` is applied to the
model in memory, measured on the calibration inputs, compressed by `ModelCompressor` and saved into a staging
folder; transformers then loads that folder and its KL from the unquantized model must be the measurement's.
llm-compressor's `oneshot` is not used: its calibration algorithms are not what the measurement measures, and
its releases pin other transformers releases than this package's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .. import CLIError, __version__, register_auto_classes
from ..analysis.analyze import checked_inputs
from ..analysis.samples import DatasetSpec, builtin_samples, dataset_samples, read_text_file
from ..convert.errors import ConversionError
from ..convert.folders import check_destination, check_source, staged_folder
from ..files.datasets import DataError
from ..hub.model_card import options_rows, write_model_card
from ..hub.provenance import cached_folder, read_provenance, record_commit
from ..quantization import measure
from ..quantization.rounding import quantize_in_place
from ..quantization.schemes import QuantizationError, canonical
from ..quantization.ignore import ignore_section
from ..quantization.targets import arms, gate_patterns

# Formats whose packed weights transformers decompresses into bfloat16 when it runs them compressed on a CPU, so
# that a float32 model cannot run them there: the written weights are checked, the KL is not.
BFLOAT16_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
RECIPE = ("compressed-tensors alone, round-to-nearest with min-max scales (static activation and global scales "
          "from the calibration inputs), the scales llm-compressor's QuantizationModifier computes; llm-compressor "
          "itself is not run")


def _samples(args):
    if args.text_file:
        samples = read_text_file(args.text_file)
        if not samples:
            raise CLIError(f"--text-file {args.text_file} holds no text")
        return samples
    if args.dataset:
        try:
            return dataset_samples([DatasetSpec(tuple(args.dataset), args.text_field)], args.n_per_domain,
                                   max_chars=args.max_length * 1024)
        except DataError as e:
            raise CLIError(str(e)) from None
    return builtin_samples(args.n_per_domain)


def _load(model_name: str, revision: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_auto_classes()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32, revision=revision).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_name, revision=revision)
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot load MODEL {model_name}: {str(e).splitlines()[0]}") from None
    if getattr(model.config, "quantization_config", None) is not None:
        raise CLIError(f"MODEL {model_name} is quantized already ({model.config.quantization_config.get('quant_method')})")
    return model, tokenizer


def quantize_checkpoint(args) -> Path:
    try:
        check_source(args.model, args.revision)
        check_destination(Path(args.model).expanduser() if Path(args.model).expanduser().exists() else None,
                          Path(args.dst).expanduser(), args.overwrite)
        scheme = canonical(args.scheme)
    except (ConversionError, QuantizationError) as e:
        raise CLIError(str(e)) from None
    samples = _samples(args)
    model, tokenizer = _load(args.model, args.revision)
    try:
        ids = [i for _, i in checked_inputs(model, tokenizer, samples, args.max_length, args.model)]
        plan = arms(model)
        if args.gates == "keep" and "gates_kept" not in plan:
            raise QuantizationError(f"MODEL {args.model} has no gate of linear maps: --gates keep would keep nothing "
                                    "(leave --gates out)")
        keep = args.gates == "keep" or (args.gates is None and "gates_kept" in plan)  # the default: keep what there is
        arm = "gates_kept" if keep else "all"
        measure.check_schemes(model, [scheme])
        ref = measure.reference(model, ids)
        quantize_in_place(model, scheme, list(plan[arm]), ids)
        measured = {**measure.compare(model, ref), "weight_bytes": measure.weight_bytes(model, scheme, plan[arm])}
    except (QuantizationError, ValueError) as e:
        raise CLIError(str(e).splitlines()[0]) from None
    print(f"recipe: {RECIPE}")
    print(f"{scheme}, gates {'kept' if arm == 'gates_kept' else 'rounded'} (arm {arm}): perplexity "
          f"{measured['perplexity']:.4g} (unquantized {ref.perplexity:.4g}), KL {measured['kl']:.3g}, top-1 agreement "
          f"{measured['top1_agreement']:.3f} over {measured['n_tokens']} predictions")
    fused = "gate_rows_only" in plan
    dst = Path(args.dst).expanduser()
    try:
        with staged_folder(dst, args.overwrite) as stage:
            _write(model, tokenizer, stage, args, scheme, arm, measured, ref, fused)
            _verify(stage, ref, measured)
    except ConversionError as e:
        raise CLIError(str(e)) from None
    print(f"wrote {dst}")
    return dst


def _write(model, tokenizer, stage: Path, args, scheme: str, arm: str, measured: dict, ref, fused: bool) -> None:
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(stage)
    compressor.update_config(stage)
    tokenizer.save_pretrained(stage)
    source = read_provenance(args.model, cached_folder(args.model, args.revision))
    record_commit(stage, source.commit)
    write_model_card(
        stage, "quantized_model", source=source, relation="quantized",
        tags=["gated-attention", "compressed-tensors", scheme.lower()],
        title=f"{Path(args.model).name} ({scheme})",
        scheme=scheme, recipe=RECIPE + ".",
        options_rows=options_rows({"source": args.model, "--scheme": scheme, "--gates": "keep" if arm == "gates_kept" else "quantize",
                                   "calibration": args.text_file or (" ".join(args.dataset) if args.dataset else "built-in samples"),
                                   "--max-length": args.max_length}),
        measurement=(f"On the calibration inputs ({measured['n_tokens']} predictions): perplexity "
                     f"{measured['perplexity']:.4g} against {ref.perplexity:.4g} unquantized, mean KL "
                     f"{measured['kl']:.3g} nats, top-1 agreement {measured['top1_agreement']:.3f}; its linear maps "
                     f"take {measured['weight_bytes']:,} bytes."),
        ignore_lists=ignore_section(gate_patterns(fused), "every gate module" + ("; a gate fused into `q_proj` is kept by "
                                    "keeping that `q_proj` with its `k_proj` and `v_proj`" if fused else "")),
        repo=args.dst, version=__version__,
    )


@torch.no_grad()
def _verify(stage: Path, ref, measured: dict) -> None:
    """The written checkpoint, loaded by transformers as users load it (run compressed), gives the measured KL:
    the same compressed-tensors forward on the same numbers. Formats that transformers runs only in bfloat16 on a
    CPU (`BFLOAT16_FORMATS`) are run so, and their KL is said, not compared."""
    from transformers import AutoModelForCausalLM

    form = json.loads((stage / "config.json").read_text())["quantization_config"].get("format")
    if form in BFLOAT16_FORMATS:
        loaded = AutoModelForCausalLM.from_pretrained(stage, dtype=torch.bfloat16).eval()
        got = measure.compare(loaded, ref)
        print(f"verify: transformers runs {form} in bfloat16 on a CPU: loaded so, KL {got['kl']:.3g} (measured in "
              f"float32 {measured['kl']:.3g}), top-1 agreement {got['top1_agreement']:.3f}; not compared")
        return
    loaded = AutoModelForCausalLM.from_pretrained(stage).eval()
    got = measure.compare(loaded, ref)
    print(f"verify: the written checkpoint, loaded as users load it: KL {got['kl']:.3g} (measured {measured['kl']:.3g}), "
          f"top-1 agreement {got['top1_agreement']:.3f}")
    if not math.isclose(got["kl"], measured["kl"], rel_tol=1e-6, abs_tol=1e-12):
        raise CLIError(f"the written checkpoint gives KL {got['kl']:.3g} where the quantized model gave "
                       f"{measured['kl']:.3g}; nothing was written")
