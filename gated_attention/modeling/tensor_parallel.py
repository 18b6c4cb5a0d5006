"""Tensor parallelism in transformers: the styles our plan adds, and the shapes that can be sharded.

The plan itself is the config's (`configuration/tensor_parallel.py`). This
module registers the two styles that plan names for head-shared gates, and checks
at load that the heads split evenly over the ranks, so an unshardable shape is
one clear error instead of a reshape failure deep inside a forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from ..compat import EXPERT_GRADIENTS_WRONG_UNDER_FSDP, tensor_parallel_api
from ..configuration.gate_spec import GATE_ALIASES, gate_enabled
from ..configuration.tensor_parallel import REPLICATED_SUM_OUTPUT_GRAD, SHARDED_GATHERED_SUM_GRAD

_tp = tensor_parallel_api()
_POSITION_NAMES = {position: alias for alias, position in GATE_ALIASES.items()}


class _SumGradAcrossRanks(torch.autograd.Function):
    """Identity forward; the backward sums the incoming gradient over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_output_grad(output: torch.Tensor, mesh) -> torch.Tensor:
    if not torch.is_grad_enabled() or not output.requires_grad:
        return output
    return _SumGradAcrossRanks.apply(output, mesh.get_group())


class ColwiseGatheredSumOutputGrad(_tp.ColwiseParallel):
    """A head-shared elementwise gate: each rank holds a shard of its weights, computes all its scores
    (gathered), and applies them to its own heads only.

    The gradient of the gathered scores on one rank then covers that rank's
    heads; it is summed over the ranks before the gather's backward takes this
    rank's slice of it, which is then the gradient of one process.
    """

    def __init__(self):
        from torch.distributed.tensor import Replicate  # here: a torch built without distributed has no DTensor

        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

    # `**kwargs`: what the installed release passes besides these (5.25: `config=`), handed on unchanged.
    def transform_output_post_forward(self, module, output, mesh, **kwargs):
        return _sum_output_grad(super().transform_output_post_forward(module, output, mesh, **kwargs), mesh)


class ReplicatedSumOutputGrad(_tp.TensorParallelLayer):
    """A head-shared headwise gate (one score, too small to split): whole on every rank, its output's gradient
    summed over the ranks as above, so its parameters get one process's gradient on every rank."""

    def transform_output_post_forward(self, module, output, mesh, **kwargs):
        return _sum_output_grad(output, mesh)


if dist.is_available():  # as transformers registers its own styles
    _tp.ALL_PARALLEL_STYLES.register(SHARDED_GATHERED_SUM_GRAD, ColwiseGatheredSumOutputGrad())
    _tp.ALL_PARALLEL_STYLES.register(REPLICATED_SUM_OUTPUT_GRAD, ReplicatedSumOutputGrad())


def gate_name(spec: dict) -> str:
    """`G2 (value) headwise, head-shared` style name of a normalised gate spec, for messages."""
    name = f"{_POSITION_NAMES[spec['position']]} ({spec['position']}) {spec['granularity']}"
    return name + (", head-shared" if spec["head_shared"] else "")


def check_distributed_config(config) -> None:
    """Raise a one-line `ValueError` for a `distributed_config` (set by `from_pretrained` before the model is built)
    this model cannot run under: heads that do not split over `tp_size` ranks, or experts sharded under FSDP in the
    transformers releases that give them wrong gradients (`compat.EXPERT_GRADIENTS_WRONG_UNDER_FSDP`)."""
    distributed = getattr(config, "distributed_config", None)
    sizes = {name: getattr(distributed, name, None) or 1 for name in ("tp_size", "fsdp_size", "ep_size")}
    if sizes["tp_size"] > 1:
        check_tensor_parallel_shapes(config, sizes["tp_size"])
    if EXPERT_GRADIENTS_WRONG_UNDER_FSDP and getattr(config, "num_experts", 0) and sizes["fsdp_size"] > 1 and sizes["ep_size"] > 1:
        raise ValueError(
            f"transformers {transformers.__version__} gives the experts wrong gradients with fsdp_size and ep_size "
            "together (its own Qwen3-MoE too); use tp_size with ep_size, or transformers>=5.23"
        )


def check_tensor_parallel_shapes(config, tp_size: int) -> None:
    """Raise one-line `ValueError`s for a config whose attention heads do not split over `tp_size` ranks.

    q/k/v and every per-head gate are sharded by head, so both head counts must
    be multiples of tp_size (transformers' own Qwen3 needs the same, and fails
    inside its forward otherwise). Gated DeltaNet layers gather their outputs,
    so their head counts are free.
    """
    if all(t == "linear_attention" for t in config.layer_types):
        return
    spec = config.attn_gate
    sharded_gate = gate_enabled(spec) and spec["position"] != "dense" and not spec["head_shared"]
    gate = f"the {gate_name(spec)} gate" if sharded_gate else None
    on_kv = sharded_gate and spec["position"] in ("key", "value")
    for field, sharded in (
        ("num_attention_heads", "q_proj and o_proj" + (f" and {gate}" if gate and not on_kv else "")),
        ("num_key_value_heads", "k_proj and v_proj" + (f" and {gate}" if on_kv else "")),
    ):
        heads = getattr(config, field)
        if heads % tp_size:
            raise ValueError(
                f"tensor parallelism over {tp_size} ranks cannot split {field}={heads}: {sharded} are sharded by "
                f"head, so it must be a multiple of tp_size"
            )
