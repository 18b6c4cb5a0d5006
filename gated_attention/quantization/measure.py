"""Each arm of each scheme against the unquantized model on the same inputs, and the outlier statistics that
predict the error.

Per scheme and arm (`targets.arms`), over every next-token prediction of every input (positions 0..T-2 of each
input `[1, T]`, predicting tokens 1..T-1):
- `perplexity`: exp of the mean negative log-likelihood of the next token under the quantized model;
- `perplexity_change`: its ratio to the unquantized model's perplexity on the same tokens, minus 1 (0.05: 5 %
  higher);
- `kl`: the mean KL divergence KL(P || Q) of the quantized model's next-token distribution Q from the
  unquantized one's P, in nats;
- `top1_agreement`: the fraction of predictions whose most likely token is the unquantized model's;
- `weight_bytes`: the bytes of the linear maps the schemes round (not `lm_head` or the embeddings) as the arm
  stores them: rounded weights at the scheme's bits plus their scales, the others at 16 bits, as served.

The outlier statistics (`outliers`) are read from the unquantized model, one forward per input, at the input of
each attention output projection, MLP down projection and gate: the kurtosis of the input's values (all tokens
and channels of one input; 3 for a Gaussian, far more where a few channels carry massive activations) and the
ratio of its largest magnitude to its median magnitude, each averaged over inputs, and the largest magnitude.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..modeling.attention_sites import OUTPUT_PROJECTIONS
from ..modeling.recorded_outputs import declaration, declared_modules, softmax_attention
from .rounding import quantized_copy, run_observed
from .schemes import QuantizationError, canonical, check_shapes, scheme
from .targets import FUSED_ARMS, arms, gate_rows, linear_paths

# The MLP's last matrix, by name, in the models the package reads (Llama's and Qwen's, GPT-2's, fla's).
DOWN_PROJECTIONS = ("down_proj", "c_proj", "fc2", "w2")
COLUMNS = ("scheme", "arm", "perplexity", "perplexity_change", "kl", "top1_agreement", "weight_bytes", "n_tokens")


@dataclass
class Reference:
    """The unquantized model's next-token log-probabilities on each input, `[T - 1, V]` float32 each."""

    inputs: list[torch.Tensor]  # token ids [1, T]
    log_probs: list[torch.Tensor]
    perplexity: float


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), dim=-1).cpu()


@torch.no_grad()
def reference(model: nn.Module, inputs: Sequence[torch.Tensor]) -> Reference:
    log_probs = [_log_probs(model, ids) for ids in inputs]
    return Reference(list(inputs), log_probs, _perplexity(log_probs, inputs))


def _perplexity(log_probs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> float:
    nll = sum(-lp.gather(-1, ids[0, 1:, None].cpu()).sum().item() for lp, ids in zip(log_probs, inputs))
    return math.exp(nll / sum(ids.shape[1] - 1 for ids in inputs))


@torch.no_grad()
def compare(model: nn.Module, ref: Reference) -> dict[str, float]:
    """`model`'s perplexity, KL from the reference and top-1 agreement on the reference's inputs."""
    kl, agree, n = 0.0, 0, 0
    log_probs = []
    for ids, p in zip(ref.inputs, ref.log_probs):
        q = _log_probs(model, ids)
        log_probs.append(q)
        kl += F.kl_div(q, p, log_target=True, reduction="sum").item()  # sum over positions of KL(P || Q)
        agree += int((q.argmax(-1) == p.argmax(-1)).sum())
        n += p.shape[0]
    perplexity = _perplexity(log_probs, ref.inputs)
    return {"perplexity": perplexity, "perplexity_change": perplexity / ref.perplexity - 1, "kl": kl / n,
            "top1_agreement": agree / n, "n_tokens": n}


def weight_bytes(model: nn.Module, name: str | None, rounded: dict[str, torch.Tensor | None]) -> int:
    """The bytes of `model`'s rounded linear maps (`targets.linear_paths`) with `rounded` at the scheme's bits and
    their scales, the rest at 16 bits. A mask rounds its rows' share."""
    args = scheme(name).weights if name else None
    total = 0
    for path, linear in linear_paths(model).items():
        numel = linear.weight.numel()
        share = 0.0
        if args is not None and path in rounded:
            rows = rounded[path]
            share = 1.0 if rows is None else float(rows.float().mean())
        total += round(numel * (1 - share) * 2 + (share * _rounded_bytes(linear, args) if share else 0))
    return total


def _rounded_bytes(linear: nn.Linear, args) -> float:
    from compressed_tensors.quantization import QuantizationStrategy as S

    out, width = linear.weight.shape
    scales = {S.TENSOR: 1, S.CHANNEL: out}.get(args.strategy)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        scales = out * math.ceil(width / args.group_size)
    elif args.strategy == S.BLOCK:
        scales = math.ceil(out / args.block_structure[0]) * math.ceil(width / args.block_structure[1])
    scale_bytes = 1 if args.scale_dtype is not None and args.scale_dtype.itemsize == 1 else 2
    return out * width * args.num_bits / 8 + scales * scale_bytes + (4 if args.strategy == S.TENSOR_GROUP else 0)


def check_schemes(model: nn.Module, names: Sequence[str]) -> list[str]:
    """The schemes' canonical names, each checked against `model`'s linear maps (`schemes.check_shapes`)."""
    linears = linear_paths(model)
    out = []
    for name in names:
        check_shapes(name, linears)
        out.append(canonical(name))
    return list(dict.fromkeys(out))


def measure(model: nn.Module, inputs: Sequence[torch.Tensor], names: Sequence[str],
            progress: Callable[[str], None] | None = None) -> tuple[Reference, list[dict]]:
    """One row per scheme and arm (`COLUMNS`), each arm rounded on a copy of `model` (`rounding.quantized_copy`,
    static scales from `inputs`)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise QuantizationError("--quantization rounds a copy of the whole model in memory, and part of this one is "
                                "read from disk as it runs: give a --max-memory that holds it twice")
    names = check_schemes(model, names)
    ref = reference(model, inputs)
    plan = arms(model)
    rows = [{"scheme": "none", "arm": "none", "perplexity": ref.perplexity, "perplexity_change": 0.0, "kl": 0.0,
             "top1_agreement": 1.0, "weight_bytes": weight_bytes(model, None, {}),
             "n_tokens": sum(ids.shape[1] - 1 for ids in inputs)}]
    steps = [(name, arm) for name in names for arm in plan]
    for name, arm in tqdm(steps, desc="quantization", unit="arm"):
        quantized = quantized_copy(model, name, plan[arm], inputs)
        rows.append({"scheme": name, "arm": arm, **compare(quantized, ref),
                     "weight_bytes": weight_bytes(model, name, plan[arm])})
        del quantized
    return ref, rows


# ---------------------------------------------------------------- outlier statistics


def outlier_sites(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Linear path -> (kind, layer) for each attention output projection, MLP down projection and gate whose
    input is measured; kind "attention_output", "mlp_down" or "gate", layer the path's `layers.N` (1-based), or
    the path where it has none."""
    found: dict[str, tuple[str, str]] = {}
    linears = linear_paths(model)
    is_attention = softmax_attention(declaration(model).get("attentions", []))
    for attention, _ in declared_modules(model, is_attention):
        path = next((p for name in OUTPUT_PROJECTIONS if (p := f"{attention}.{name}".lstrip(".")) in linears), None)
        if path is not None:
            found[path] = ("attention_output", _layer(path))
    for path in linears:
        parent, _, leaf = path.rpartition(".")
        if leaf in DOWN_PROJECTIONS and re.search(r"(^|\.)(mlp|feed_forward|shared_expert)(\.|$)", parent):
            found[path] = ("mlp_down", _layer(path))
    for path, rows in gate_rows(model).items():
        if path in linears and rows is None:  # a fused q_proj's input is the query's too: not the gate's alone
            found[path] = ("gate", _layer(path))
    return dict(sorted(found.items(), key=lambda item: list(linears).index(item[0])))


def _layer(path: str) -> str:
    match = re.search(r"layers\.(\d+)\.", path)
    return str(int(match.group(1)) + 1) if match else path


@torch.no_grad()
def outliers(model: nn.Module, inputs: Sequence[torch.Tensor]) -> list[dict]:
    """Per measured linear map (`outlier_sites`): kurtosis and max/median magnitude of its input, averaged over
    inputs, and its largest magnitude."""
    sites = outlier_sites(model)
    sums: dict[str, list[float]] = {path: [0.0, 0.0, 0.0] for path in sites}  # kurtosis, max/median, max

    def observe(path):
        def hook(module, args):
            x = args[0].detach().double().flatten()
            centred = x - x.mean()
            variance = centred.pow(2).mean()
            magnitude = x.abs()
            acc = sums[path]
            acc[0] += float(centred.pow(4).mean() / variance.pow(2)) if variance > 0 else math.nan
            acc[1] += float(magnitude.max() / magnitude.median()) if magnitude.median() > 0 else math.nan
            acc[2] = max(acc[2], float(magnitude.max()))
        return hook

    run_observed(model, {model.get_submodule(path): observe(path) for path in sites}, inputs)
    n = len(inputs)
    return [{"module": path, "kind": kind, "layer": layer, "kurtosis": sums[path][0] / n,
             "max_over_median": sums[path][1] / n, "max_abs": sums[path][2]} for path, (kind, layer) in sites.items()]


def fused(rows: list[dict]) -> bool:
    return any(row["arm"] in FUSED_ARMS for row in rows)
