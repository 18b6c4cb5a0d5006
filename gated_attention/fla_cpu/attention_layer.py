"""fla's softmax `Attention` layer on the torch path: its flash-attn calls answered in torch, its own forward
returning the weights.

fla's layer (the full-attention layers of fla's hybrids, `config.attn`) calls
flash-attn on every device, and without flash-attn its constructor refuses to
build. `patch_attention` sets the names its module calls, `flash_attn_func`
and `flash_attn_varlen_func` in `fla.layers.attn`, to flash-attn's calls in
torch (`modules.softmax_attention`: scores and softmax in fp32), and wraps the
layer's own forward: its projections, norms, rotary, cache and unpadding stay
fla's code, and the wrapper returns the weights the calls computed, `[B, HQ, T,
S]` in fp32, as the layer's second output (fla returns None there) for a
forward hook to read. A padded batch reaches flash-attn unpadded, one packed
sequence per row: `unpad_input` is watched to put each row's weights back at
its tokens' positions.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch

from .modules.softmax_attention import flash_attention, flash_attention_varlen

# What the flash-attn stand-ins and fla's `unpad_input` saw during each fla `Attention.forward` now running
# (innermost last): the weights, and where the rows of a padded batch went.
_SEEN: list[dict] = []


def _see(**found) -> None:
    if _SEEN:
        _SEEN[-1].update(found)


def _flash_attn_func(*args, **kwargs):
    o, weights = flash_attention(*args, **kwargs)
    _see(weights=weights)
    return o


def _flash_attn_varlen_func(*args, **kwargs):
    o, weights = flash_attention_varlen(*args, **kwargs)
    bounds = inspect.signature(flash_attention_varlen).bind(*args, **kwargs).arguments
    _see(blocks=weights, cu_seqlens=(bounds["cu_seqlens_q"], bounds["cu_seqlens_k"]))
    return o


def _seeing_unpad_input(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def unpad_input(*args, **kwargs):
        out = original(*args, **kwargs)
        _see(mask=signature.bind(*args, **kwargs).arguments["attention_mask"], indices_q=out[2])
        return out

    return unpad_input


def _weights(seen: dict, batch_size: int, q_len: int) -> torch.Tensor | None:
    """The weights the stand-ins saw, laid out `[B, HQ, T, S]` as fla's layer took its inputs.

    A padded batch was unpadded into one packed sequence per row (`unpad_input`): the weights of row b go
    back to its tokens' positions (`indices_q` of the queries, the mask's ones of the keys), zeros
    elsewhere. Sequences packed by the caller (`cu_seqlens`, B = 1) sit on the diagonal of `[1, HQ, T, T]`.
    """
    if "weights" in seen:
        return seen["weights"]
    if "blocks" not in seen:
        return None
    blocks, (cu_q, cu_k) = seen["blocks"], seen["cu_seqlens"]
    heads, device = blocks[0].shape[0], blocks[0].device
    if "mask" in seen:
        mask = seen["mask"]
        S = mask.shape[-1]
        sequence = torch.arange(batch_size, device=device).repeat_interleave(cu_q.diff().long().to(device))
        rows = seen["indices_q"].to(device) - sequence * q_len
        keys = mask.flatten().nonzero().flatten().to(device) % S
    elif batch_size == 1:
        S = q_len
        rows = keys = torch.arange(q_len, device=device)
    else:
        raise RuntimeError("fla's Attention called flash-attn's varlen attention on a batch it did not unpad with "
                           "unpad_input: its weights cannot be laid out (is this a newer fla?)")
    out = blocks[0].new_zeros(batch_size, heads, q_len, S)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i, block in enumerate(blocks):
        r, c = rows[cu_q[i] : cu_q[i + 1]], keys[cu_k[i] : cu_k[i + 1]]
        out[i if "mask" in seen else 0, :, r[:, None], c[None, :]] = block
    return out


def _attention_forward(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        """fla's own `Attention.forward`, its flash-attn calls answered in torch; returns `(o, weights
        [B, HQ, T, S] in fp32, cache)`, where fla returns no weights."""
        bound = signature.bind(self, *args, **kwargs)
        # fla's layer computes no weights: its forward sets its second output only when not asked for them.
        bound.arguments["output_attentions"] = False
        batch_size, q_len = bound.arguments["hidden_states"].shape[:2]
        _SEEN.append({})
        try:
            o, _, cache = original(*bound.args, **bound.kwargs)
            seen = _SEEN[-1]
        finally:
            _SEEN.pop()
        return o, _weights(seen, batch_size, q_len), cache

    forward.fla_original = original
    return forward


def patch_attention(restore: list[Callable[[], None]]) -> None:
    """Point fla's `Attention` (where `fla.layers.attn` is imported) at the torch calls and wrap its forward;
    `restore` gets what undoes each change."""
    module = sys.modules.get("fla.layers.attn")
    if module is None:
        return
    replaced = {"flash_attn_func": _flash_attn_func, "flash_attn_varlen_func": _flash_attn_varlen_func}
    if hasattr(module, "unpad_input"):
        replaced["unpad_input"] = _seeing_unpad_input(module.unpad_input)
    for name, value in replaced.items():  # without flash-attn, fla's module has flash_attn_func = None alone
        undo = functools.partial(setattr, module, name, getattr(module, name)) if hasattr(module, name) else \
            functools.partial(delattr, module, name)
        setattr(module, name, value)
        restore.append(undo)
    layer = module.Attention
    original_forward = layer.forward
    layer.forward = _attention_forward(original_forward)
    restore.append(lambda: setattr(layer, "forward", original_forward))
