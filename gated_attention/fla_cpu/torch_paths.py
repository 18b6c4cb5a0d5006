"""`fla_torch_paths()`: while open, fla's layers run this package's torch paths on CPU tensors.

flash-linear-attention (fla) imports fine on a machine without a GPU and then
fails in its first Triton kernel (also under `TRITON_INTERPRET=1`, where its
autotuner asks for a driver). Its layers call the kernels through names they
imported (`chunk_gla`, `causal_conv1d`, `rms_norm`, `rotary_embedding`, ...).
While the context is open, each of those names, in every loaded `fla` module
that holds it, is replaced by a function that looks at its tensors' device:
on a CUDA tensor it calls fla's kernel as before, on any other it calls the
torch implementation that `TORCH_PATHS` names for it (logged once). On exit
every name is put back, also when the body raised.

| fla (what its layers call) | torch path here |
|---|---|
| `chunk_gla`, `fused_recurrent_gla` (GLA, HGRN2) | `gla.torch_gla` |
| `chunk_simple_gla`, `fused_recurrent_simple_gla`, `fused_chunk_simple_gla` | `simple_gla.torch_simple_gla` |
| `chunk_retention`, `fused_chunk_retention`, `fused_recurrent_retention`, `parallel_retention` (RetNet) | `simple_gla.torch_retention` |
| `chunk_hgrn`, `fused_recurrent_hgrn` (HGRN) | `hgrn.torch_hgrn` |
| `chunk_delta_rule`, `fused_recurrent_delta_rule` (DeltaNet) | `delta_rule.torch_delta_rule` |
| `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule` (Gated DeltaNet) | `kernels.gated_delta_rule.torch_gated_delta_rule` (the package's own) |
| `chunk_kda`, `fused_recurrent_kda` (KDA) | `kda.torch_kda` |
| `causal_conv1d`, `causal_conv1d_update` (`ShortConvolution`) | `modules.short_convolution` |
| `layer_norm`, `rms_norm`, `*_norm_linear`, `*_norm_gated`, `*_norm_swish_gate_linear` | `modules.norms` |
| `rotary_embedding` (`RotaryEmbedding`) | `modules.rotary.torch_rotary_embedding` |
| `swish`, `sigmoid`, `logsigmoid`, `elu_p1`, `swiglu`, `swiglu_linear` | torch's functions |
| `swish_fwd`, `swish_bwd`, ... (the kernels behind a stored `ACT2FN[...]`) | torch's functions |
| `fused_linear_cross_entropy_loss` (`fuse_linear_cross_entropy=True`) | `modules.cross_entropy.torch_linear_cross_entropy_loss` |

fla's softmax `Attention` layer (the full-attention layers of fla's hybrids)
calls flash-attn, on every device: while the context is open, those calls are
answered in torch and its own forward returns the attention weights
(`attention_layer`).

fla's `FusedCrossEntropyLoss` (a forward with labels, `fuse_cross_entropy=True`,
fla's default) asserts a CUDA tensor before its kernel runs: while the context
is open, its forward on any other tensor is `cross_entropy_forward`, the same
loss in torch (`modules.cross_entropy.torch_cross_entropy_loss`).

Open the context before building or loading an fla model (for the attention
layers) and around its forwards. It patches fla as it is imported when the
context opens, and never imports fla itself (importing fla registers its
model types, `mamba` and `mamba2` among them, with transformers' Auto
classes); with fla not imported it does nothing. Not covered: `attnres`
blocks, and backward passes through the mixers other than Gated DeltaNet's
(the chunked paths work in place, for forwards: GLA, RetNet, HGRN2, DeltaNet
and KDA raise autograd's in-place error, HGRN its `out=` one).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from transformers.utils import logging

from ..kernels.gated_delta_rule.chunk import torch_gated_delta_rule
from .attention_layer import patch_attention
from .chunking import state_in, state_out
from .delta_rule.chunk import torch_delta_rule
from .modules.cross_entropy import reduced, torch_cross_entropy_loss, torch_linear_cross_entropy_loss
from .modules.norms import (
    torch_layer_norm,
    torch_layer_norm_gated,
    torch_layer_norm_linear,
    torch_layer_norm_swish_gate_linear,
    torch_rms_norm,
    torch_rms_norm_gated,
    torch_rms_norm_linear,
    torch_rms_norm_swish_gate_linear,
)
from .modules.rotary import torch_rotary_embedding
from .modules.short_convolution import torch_causal_conv1d, torch_causal_conv1d_update
from .gla.chunk import torch_gla
from .hgrn.chunk import torch_hgrn
from .kda.chunk import kda_gate, torch_kda
from .simple_gla.chunk import torch_retention, torch_simple_gla

logger = logging.get_logger(__name__)

# Arguments fla's entry points take that only steer its kernels (tiling, graphs, precomputed
# indices); the torch paths compute the same numbers without them.
_KERNEL_ONLY = frozenset(
    {"cu_seqlens_cpu", "chunk_indices", "chunk_size", "disable_recompute", "use_graph", "max_num_seqs",
     "safe_gate", "cp_context", "backend", "seq_idx", "inplace_backward", "num_chunks", "accumulate_grad_in_fp32"}
)


def _kernel_options_only(op: str, kwargs: dict) -> None:
    """Refuse an argument that would change the numbers and that the torch path does not implement."""
    unknown = [key for key, value in kwargs.items()
               if key not in _KERNEL_ONLY and value is not None and value is not False]
    if unknown:
        raise NotImplementedError(f"{op} on the torch path: {sorted(unknown)} is not implemented")


# ------------------------------------------------------------------ fla's op signatures -> ours


def _gla(q, k, v, g=None, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
         reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    _kernel_options_only("gla", dict(kwargs, gv=gv, reverse=reverse))
    return torch_gla(q, k, v, g if g is not None else gk, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def _simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    _kernel_options_only("simple_gla", dict(kwargs, reverse=reverse))
    return torch_simple_gla(q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, state_v_first=state_v_first,
                            cu_seqlens=cu_seqlens)


def _retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
               state_v_first=False, cu_seqlens=None, output_attentions=False, **kwargs):
    _kernel_options_only("retention", dict(kwargs, reverse=reverse, output_attentions=output_attentions))
    return torch_retention(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                           state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def _hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    _kernel_options_only("hgrn", kwargs)
    return torch_hgrn(x, g, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    _kernel_options_only("delta_rule", kwargs)
    if beta is None:
        beta = q.new_ones(q.shape[:-1])
    return torch_delta_rule(q, k, v, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens)


def _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    if not use_beta_sigmoid_in_kernel:
        return beta
    beta = beta.float().sigmoid()
    return beta * 2 if allow_neg_eigval else beta


def _gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                      state_v_first=False, cu_seqlens=None, gk=None, gv=None, use_gate_in_kernel=False,
                      A_log=None, dt_bias=None, **kwargs):
    _kernel_options_only("gated_delta_rule", dict(kwargs, gk=gk, gv=gv))
    if use_gate_in_kernel:  # fla's GDN layer: g is a_proj(x), the decay is -exp(A_log) softplus(g + dt_bias)
        g = g.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        g = -A_log.float().exp() * F.softplus(g)
    elif g is None:
        g = v.new_zeros(v.shape[:-1], dtype=torch.float32)
    o, state = torch_gated_delta_rule(
        q, k, v, g, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), scale=scale,
        initial_state=state_in(initial_state, state_v_first), output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o, state_out(state, state_v_first)


def _kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
         use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
         state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None, return_intermediate_states=False,
         **kwargs):
    _kernel_options_only("kda", dict(kwargs, return_intermediate_states=return_intermediate_states))
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    return torch_kda(q, k, v, g, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens)


def _causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                   activation=None, cu_seqlens=None, **kwargs):
    _kernel_options_only("causal_conv1d", kwargs)
    return torch_causal_conv1d(x, weight, bias, residual=residual, initial_state=initial_state,
                               output_final_state=output_final_state, activation=activation, cu_seqlens=cu_seqlens)


def _swiglu(x, y):
    return F.silu(x.float()).mul(y.float()).to(x.dtype)


def _swiglu_linear(x, y, weight, bias):
    return F.linear(_swiglu(x, y), weight, bias)


def _swish(x):
    return F.silu(x.float()).to(x.dtype)


def _sigmoid(x):
    return torch.sigmoid(x.float()).to(x.dtype)


def _logsigmoid(x, temperature: float = 1.0):
    return (F.logsigmoid(x.float()) / temperature).to(x.dtype)


def _elu_p1(x):
    return (F.elu(x.float()) + 1.0).to(x.dtype)


# The kernels behind fla's activation Functions (`SwishFunction.forward` calls `swish_fwd`, its backward
# `swish_bwd`). A layer that stored an activation at construction (`self.gate_fn = ACT2FN["swish"]`, GLA's and
# RetNet's output gate with `fuse_norm=False`, a `feature_map`) holds fla's Function itself, which no name
# replaced here reaches; the Function looks these names up as it runs, so they route it by device.
def _swish_fwd(x, output_contiguous=False):
    return _swish(x)


def _sigmoid_fwd(x, output_contiguous=False):
    return _sigmoid(x)


def _logsigmoid_fwd(x, temperature: float = 1.0, output_contiguous=False):
    return _logsigmoid(x, temperature)


def _swish_bwd(x, dy, output_contiguous=False):
    s = torch.sigmoid(x.float())
    return (dy.float() * s * (1 + x.float() * (1 - s))).to(x.dtype)


def _sigmoid_bwd(x, dy, output_contiguous=False):
    s = torch.sigmoid(x.float())
    return (dy.float() * s * (1 - s)).to(x.dtype)


def _logsigmoid_bwd(x, dy, temperature: float = 1.0, output_contiguous=False):
    return (dy.float() * torch.sigmoid(-x.float()) / temperature).to(x.dtype)


def _elu_p1_bwd(x, dy):
    return (dy.float() * torch.where(x > 0, 1.0, x.float().exp())).to(x.dtype)


def _linear_cross_entropy(x, target, weight, bias=None, ignore_index=-100, label_smoothing=0.0, logit_scale=1.0,
                          logit_softcapping=None, reduction="mean", use_l2warp=False, l2_penalty_factor=1e-4,
                          process_group=None, **kwargs):
    _kernel_options_only("fused_linear_cross_entropy", dict(kwargs, process_group=process_group))
    return torch_linear_cross_entropy_loss(
        x, target, weight, bias, ignore_index=ignore_index, label_smoothing=label_smoothing, logit_scale=logit_scale,
        logit_softcapping=logit_softcapping, reduction=reduction, use_l2warp=use_l2warp,
        l2_penalty_factor=l2_penalty_factor,
    )


# "module.where.fla.defines.it:name" -> the torch path. Tests may point an entry elsewhere
# (at fla's naive references) to compare a whole model against them.
TORCH_PATHS: dict[str, Callable] = {
    "fla.ops.gla:chunk_gla": _gla,
    "fla.ops.gla:fused_recurrent_gla": _gla,
    "fla.ops.gla:fused_chunk_gla": _gla,
    "fla.ops.simple_gla:chunk_simple_gla": _simple_gla,
    "fla.ops.simple_gla:fused_chunk_simple_gla": _simple_gla,
    "fla.ops.simple_gla:fused_recurrent_simple_gla": _simple_gla,
    "fla.ops.retention:chunk_retention": _retention,
    "fla.ops.retention:fused_chunk_retention": _retention,
    "fla.ops.retention:fused_recurrent_retention": _retention,
    "fla.ops.retention:parallel_retention": _retention,
    "fla.ops.hgrn:chunk_hgrn": _hgrn,
    "fla.ops.hgrn:fused_recurrent_hgrn": _hgrn,
    "fla.ops.delta_rule:chunk_delta_rule": _delta_rule,
    "fla.ops.delta_rule:fused_recurrent_delta_rule": _delta_rule,
    "fla.ops.gated_delta_rule:chunk_gated_delta_rule": _gated_delta_rule,
    "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule": _gated_delta_rule,
    "fla.ops.kda:chunk_kda": _kda,
    "fla.ops.kda:fused_recurrent_kda": _kda,
    "fla.modules.causal_conv1d.ops:causal_conv1d": _causal_conv1d,
    "fla.modules.causal_conv1d.ops:causal_conv1d_update": torch_causal_conv1d_update,
    "fla.modules.norm.layernorm:layer_norm": torch_layer_norm,
    "fla.modules.norm.layernorm:rms_norm": torch_rms_norm,
    "fla.modules.norm.layernorm:layer_norm_linear": torch_layer_norm_linear,
    "fla.modules.norm.layernorm:rms_norm_linear": torch_rms_norm_linear,
    "fla.modules.norm.fused_norm_gate:layer_norm_gated": torch_layer_norm_gated,
    "fla.modules.norm.fused_norm_gate:rms_norm_gated": torch_rms_norm_gated,
    "fla.modules.norm.fused_norm_gate:layer_norm_swish_gate_linear": torch_layer_norm_swish_gate_linear,
    "fla.modules.norm.fused_norm_gate:rms_norm_swish_gate_linear": torch_rms_norm_swish_gate_linear,
    "fla.modules.rotary.ops:rotary_embedding": torch_rotary_embedding,
    "fla.modules.activations.ops:swish": _swish,
    "fla.modules.activations.ops:sigmoid": _sigmoid,
    "fla.modules.activations.ops:logsigmoid": _logsigmoid,
    "fla.modules.activations.ops:elu_p1": _elu_p1,
    "fla.modules.activations.ops:swiglu": _swiglu,
    "fla.modules.activations.ops:swiglu_linear": _swiglu_linear,
    "fla.modules.fused_linear_cross_entropy.ops:fused_linear_cross_entropy_loss": _linear_cross_entropy,
    "fla.modules.activations.ops:swish_fwd": _swish_fwd,
    "fla.modules.activations.ops:swish_bwd": _swish_bwd,
    "fla.modules.activations.ops:sigmoid_fwd": _sigmoid_fwd,
    "fla.modules.activations.ops:sigmoid_bwd": _sigmoid_bwd,
    "fla.modules.activations.ops:logsigmoid_fwd": _logsigmoid_fwd,
    "fla.modules.activations.ops:logsigmoid_bwd": _logsigmoid_bwd,
    "fla.modules.activations.ops:elu_p1_fwd": _elu_p1,
    "fla.modules.activations.ops:elu_p1_bwd": _elu_p1_bwd,
}


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether the call's first tensor argument lives on a CUDA device (where fla's kernels run)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cuda"
    return False


def _by_device(original: Callable, key: str) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if _on_cuda(args, kwargs):
            return original(*args, **kwargs)
        logger.warning_once(
            "fla layers on a CPU tensor: fla's Triton kernels need a CUDA GPU, so they run gated_attention's "
            "torch implementations instead (chunked, fp32 inside)."
        )
        # By name, as fla's own signature binds them: fla's entry points order their arguments differently.
        args, kwargs = _by_name(signature, args, kwargs)
        return TORCH_PATHS[key](*args, **kwargs)

    dispatch.fla_original = original
    return dispatch


def _by_name(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`(args, kwargs)` -> `((), every argument by its name in signature)`; unchanged for `(*args)` signatures
    (an autograd Function's `apply`), whose arguments have no names."""
    kinds = {parameter.kind for parameter in signature.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return args, kwargs
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return (), arguments


# ------------------------------------------------------------------ fla's fused cross-entropy loss


def cross_entropy_forward(self, input: torch.Tensor, target: torch.Tensor):
    """fla's `FusedCrossEntropyLoss.forward` on the torch path: logits `[N, V]`, targets `[N]` -> the loss reduced
    as fla reduces it (and the z-loss with `return_z_loss`)."""
    if self.process_group is not None:
        raise NotImplementedError("fla's cross-entropy on the torch path: a process_group is not implemented")
    loss, z_loss = torch_cross_entropy_loss(
        input, target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
        lse_square_scale=self.lse_square_scale, logit_softcapping=self.logit_softcapping,
        ignore_index=self.ignore_index,
    )
    loss, z_loss = (reduced(t, target, self.reduction, self.ignore_index) for t in (loss, z_loss))
    return (loss, z_loss) if self.return_z_loss else loss


# ------------------------------------------------------------------ the context manager


@contextlib.contextmanager
def fla_torch_paths() -> Iterator[None]:
    """While open, fla's layers on CPU tensors run the torch paths, and fla's `Attention` runs
    `attention_forward` (returning its weights) on every device; everything is restored on exit."""
    if "fla" not in sys.modules:
        yield
        return
    restore: list[Callable[[], None]] = []
    try:
        _patch_functions(restore)
        patch_attention(restore)
        _patch_cross_entropy(restore)
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _patch_functions(restore: list[Callable[[], None]]) -> None:
    originals = {}
    for key in TORCH_PATHS:
        module_name, name = key.split(":")
        try:
            original = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # another fla release: nothing of that name to route
            continue
        originals[id(original)] = (original, _by_device(original, key))
    # Every fla module that imported one of these names holds its own reference to it.
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fla" or module_name.startswith("fla.")):
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            found = originals.get(id(value))
            if found is not None and found[0] is value:
                namespace[attr] = found[1]
                restore.append(functools.partial(namespace.__setitem__, attr, value))


def _patch_cross_entropy(restore: list[Callable[[], None]]) -> None:
    module = sys.modules.get("fla.modules.fused_cross_entropy.ops")
    loss = getattr(module, "FusedCrossEntropyLoss", None)
    if loss is None:
        return
    original_forward = loss.forward

    # fla's forward asserts a CUDA tensor before its kernel runs: the layer's forward is replaced, not a name.
    @functools.wraps(original_forward)
    def forward(self, input, target):
        if input.device.type == "cuda":
            return original_forward(self, input, target)
        return cross_entropy_forward(self, input, target)

    loss.forward = forward
    restore.append(lambda: setattr(loss, "forward", original_forward))
