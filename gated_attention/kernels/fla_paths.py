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
| `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule` (Gated DeltaNet) | `gated_delta_rule.torch_gated_delta_rule` |
| `chunk_kda`, `fused_recurrent_kda` (KDA) | `kda.torch_kda` |
| `causal_conv1d`, `causal_conv1d_update` (`ShortConvolution`) | `fla_modules.short_convolution` |
| `layer_norm`, `rms_norm`, `*_norm_linear`, `*_norm_gated`, `*_norm_swish_gate_linear` | `fla_modules.norms` |
| `rotary_embedding` (`RotaryEmbedding`) | `fla_modules.rotary.torch_rotary_embedding` |
| `swish`, `sigmoid`, `logsigmoid`, `elu_p1`, `swiglu`, `swiglu_linear` | torch's functions |
| `swish_fwd`, `swish_bwd`, ... (the kernels behind a stored `ACT2FN[...]`) | torch's functions |
| `fused_linear_cross_entropy_loss` (`fuse_linear_cross_entropy=True`) | `fla_modules.cross_entropy.torch_linear_cross_entropy_loss` |

fla's softmax `Attention` layer (the full-attention layers of fla's hybrids,
`config.attn`) is different: it needs flash-attn, on any device. Without it,
its constructor raises ImportError, so a checkpoint cannot even be built.
While the context is open, on every device, the layer can be built (its
`flash_attn_func` is no longer None) and its forward is `attention_forward`:
fla's own steps (projections, q/k norms, its rotary, its cache) and then
`softmax_attention`, scores and softmax in fp32, which returns the weights
`[B, H, T, S]` as the layer's second output (fla returns None there) for a
forward hook to read.

fla's `FusedCrossEntropyLoss` (a forward with labels, `fuse_cross_entropy=True`,
fla's default) asserts a CUDA tensor before its kernel runs: while the context
is open, its forward on any other tensor is `cross_entropy_forward`, the same
loss in torch (`fla_modules.cross_entropy.torch_cross_entropy_loss`).

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

from .chunking import state_in, state_out
from .delta_rule.chunk import torch_delta_rule
from .fla_modules.cross_entropy import reduced, torch_cross_entropy_loss, torch_linear_cross_entropy_loss
from .fla_modules.norms import (
    torch_layer_norm,
    torch_layer_norm_gated,
    torch_layer_norm_linear,
    torch_layer_norm_swish_gate_linear,
    torch_rms_norm,
    torch_rms_norm_gated,
    torch_rms_norm_linear,
    torch_rms_norm_swish_gate_linear,
)
from .fla_modules.rotary import torch_rotary_embedding
from .fla_modules.short_convolution import torch_causal_conv1d, torch_causal_conv1d_update
from .fla_modules.softmax_attention import softmax_attention
from .gated_delta_rule.chunk import torch_gated_delta_rule
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


# ------------------------------------------------------------------ fla's softmax attention layer


def attention_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    output_attentions: bool = False,
    use_cache: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """fla's `Attention.forward` with flash-attn replaced by `softmax_attention`.

    The same projections, q/k norms, rotary (fla's `RotaryEmbedding`, with its
    position offsets under a cache and left padding) and cache updates as fla's
    forward, step for step; returns `(o, weights [B, H, T, S] in fp32, cache)`.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("fla's attention takes a 2-D padding mask [batch_size, seq_len] (0 for padding)")
    batch_size, q_len, _ = hidden_states.shape
    q = self.q_proj(hidden_states).unflatten(-1, (-1, self.head_dim))  # [B, T, HQ, D]
    k = self.k_proj(hidden_states).unflatten(-1, (-1, self.head_dim))  # [B, T, H, D]
    v = self.v_proj(hidden_states).unflatten(-1, (-1, self.head_dim))
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)

    cu_seqlens = kwargs.get("cu_seqlens")
    seqlen_offset, max_seqlen = 0, q_len
    if past_key_values is not None:
        seqlen_offset = past_key_values.get_seq_length(self.layer_idx)
        max_seqlen = q_len + seqlen_offset
        if cu_seqlens is None and attention_mask is not None:  # left padding shifts each row's positions
            seqlen_offset = seqlen_offset + attention_mask.sum(-1, dtype=torch.int32) - attention_mask.shape[-1]
            max_seqlen = q_len + int(seqlen_offset.max())
    if self.max_position_embeddings is not None:
        max_seqlen = max(max_seqlen, self.max_position_embeddings)
    q, k = self.rotary(q, k, seqlen_offset=seqlen_offset, max_seqlen=max_seqlen, cu_seqlens=cu_seqlens)

    if past_key_values is not None:
        cache_has_content = past_key_values.get_seq_length(self.layer_idx) > 0
        cached = past_key_values[self.layer_idx]["attn_state"] if cache_has_content else None
        k_cached, v_cached = past_key_values.update(
            attn_state=(k.flatten(-2, -1), v.flatten(-2, -1)),
            layer_idx=self.layer_idx,
            offset=q_len,
            cache_kwargs=dict(window_size=self.window_size),
        )["attn_state"]
        if self.window_size is not None and q_len > 1 and attention_mask is None and cached is not None:
            k = torch.cat([cached[0].unflatten(-1, (-1, self.head_dim)), k], dim=1)[:, -(self.window_size + q_len - 1):]
            v = torch.cat([cached[1].unflatten(-1, (-1, self.head_dim)), v], dim=1)[:, -(self.window_size + q_len - 1):]
        elif cache_has_content:
            k = k_cached.unflatten(-1, (-1, self.head_dim))
            v = v_cached.unflatten(-1, (-1, self.head_dim))

    o, weights = softmax_attention(
        q, k, v, window_size=self.window_size, attention_mask=attention_mask, cu_seqlens=cu_seqlens
    )
    return self.o_proj(o.reshape(batch_size, q_len, -1)), weights, past_key_values


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


def _flash_attn_stands_in(*args, **kwargs):
    raise RuntimeError("flash-attn is not installed; inside fla_torch_paths() fla's Attention runs attention_forward")


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
        _patch_attention(restore)
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


def _patch_attention(restore: list[Callable[[], None]]) -> None:
    module = sys.modules.get("fla.layers.attn")
    if module is None:
        return
    layer = module.Attention
    original_forward = layer.forward
    layer.forward = attention_forward
    restore.append(lambda: setattr(layer, "forward", original_forward))
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        if getattr(module, name, None) is None:  # the constructor refuses to build without flash-attn
            undo = functools.partial(setattr, module, name, None) if hasattr(module, name) else functools.partial(
                delattr, module, name)
            setattr(module, name, _flash_attn_stands_in)
            restore.append(undo)


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
