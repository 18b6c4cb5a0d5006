"""`SinkCache`: StreamingLLM's windowed KV cache (Xiao et al. 2023, "Efficient Streaming Language Models
with Attention Sinks"), the first `num_sink_tokens` entries and the most recent ones, `window_length` in all.

transformers 5 removed its own `SinkCache` (PR #41107); this one keeps that class's name and arguments and
adds the model's config, from which it builds one cache layer per layer as `DynamicCache(config=...)` does:
full-attention layers get a `SinkLayer`, while sliding-window layers keep their own window and Gated DeltaNet
(linear-attention) layers their recurrent state, untouched.

    cache = SinkCache(window_length=256, num_sink_tokens=4, config=model.config)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=1000)

Between forwards a layer holds at most `window_length` entries: the first `num_sink_tokens` and the most
recent `window_length - num_sink_tokens`. A forward's tokens attend to those and to each other, then the
oldest non-sink entries leave, as in StreamingLLM's own cache (which holds `start_size + recent_size`).
Fed one token at a time, every token attends to the `window_length` entries (the sinks and the
`window_length - num_sink_tokens` tokens before it) and to itself; a longer forward (a prompt) is attended
whole, then cut.

RoPE. StreamingLLM gives each entry its position inside the cache, not in the text. A RoPE attention score
depends only on the difference between the query's and the key's positions, so it suffices that every
difference is the in-cache one. transformers' models rotate keys before they reach the cache
(`apply_rotary_pos_emb` comes before `cache.update`), so a cache cannot store keys before rotation without
changing every attention module; this one re-rotates. Queries and new keys keep the positions generate()
and the model give them (absolute: the text's), and so do the recent entries: between them the
differences are already the in-cache ones. Only the sinks moved relative to the rest, by the number of
entries evicted after them, E: each sink key is handed to attention rotated E positions further, computed
afresh each forward from the key as it was cached (no drift from rotating again and again) with the angle
in float64. So a forward re-rotates `num_sink_tokens` keys per layer, never the window, and positions,
masks and padding stay as transformers computes them. Absolute positions have one cost: the model's own
rotary embedding computes cos/sin in float32, whose angle error grows with the position (about 6e-8 rad
per unit: 0.06 rad at a million tokens), where in-cache positions would stay below the window.

The rotation is the model's own: its modeling module's `rotate_half` (rotate-half or interleaved pairs, read off
the function) on the first channels its rotary embedding covers, with the frequencies that rotary embedding
computes (per layer type where the model has several RoPEs, Gemma 3). Refused, in one line: RoPE types whose
frequencies change with the sequence length (`dynamic`, `longrope`), a rotary table without frequencies
(GPT-J), keys rotated on their last channels (multi-head latent attention), sinks on a model without RoPE,
and a config neither transformers' nor this package's. docs/streaming.md has the table.

Masks: a layer numbers its entries 0..n-1 for transformers' mask builders (`get_mask_sizes` with no
offset, `SinkCache.get_query_offset` = n), so the new tokens are causal among themselves and see every
entry. The 2-D padding mask is then read at those numbers: exact for unpadded rows and for a left-padded
batch until the first eviction. After it, a row padded by p tokens keeps max(0, num_sink_tokens - p)
of its own tokens as sinks (its padding sits in the sink entries, masked), and where p exceeds
num_sink_tokens the first p - num_sink_tokens window entries read as padding too (masked, never padding
attended). Stream padded rows one at a time, or unpadded, for StreamingLLM's exact semantics.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half

# RoPE types whose frequencies depend on the length of the sequence being run: one rotation cannot move a cached key.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _refusal(config, reason: str) -> ValueError:
    return ValueError(f"SinkCache: {reason}; use num_sink_tokens=0 (a plain window) for the {config.model_type} model")


def _rope_parts(config):
    """The modeling module that serves `config` and its rotary embedding class: this package's models use Llama's;
    a transformers model its own module's `<Name>RotaryEmbedding` (the text one where a module has several)."""
    import importlib
    import inspect

    module_name = type(config).__module__
    if module_name.startswith("gated_attention."):
        from transformers.models.llama import modeling_llama

        return modeling_llama, modeling_llama.LlamaRotaryEmbedding
    if not module_name.startswith("transformers.models.") or ".configuration_" not in module_name:
        raise _refusal(config, f"its config ({type(config).__name__}) is not transformers' own, so how it rotates its "
                       "keys is unknown")
    module = importlib.import_module(_modeling_module(config))
    classes = {name: cls for name, cls in inspect.getmembers(module, inspect.isclass)
               if name.endswith("RotaryEmbedding") and cls.__module__ == module.__name__}
    named = type(config).__name__.removesuffix("Config") + "RotaryEmbedding"
    if named not in classes:
        text = [name for name in classes if not any(part in name for part in ("Vision", "Audio"))]
        named = text[0] if len(text) == 1 else None
    if named is None and classes:
        raise _refusal(config, f"its module has several rotary embeddings ({', '.join(classes)})")
    if named is None and (hasattr(module, "rotate_half") or hasattr(module, "rotate_every_two")):
        raise _refusal(config, "its attention rotates keys with a table of positions of its own, no rotary embedding "
                       "with frequencies to re-rotate its sink keys with")
    if named is None:
        raise _refusal(config, "the config has no rotary position embedding (rope_parameters) to re-rotate its sink "
                       "keys with")
    return module, classes[named]


def _modeling_module(config) -> str:
    """The name of the module whose classes run `config`'s model: its causal LM's (EXAONE's config is run by
    Llama's code), else the modeling file beside its configuration file."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        name = mapping.get(config.model_type)
        model_class = getattr(transformers, name, None) if isinstance(name, str) else None
        if model_class is not None:
            return model_class.__module__
    return type(config).__module__.replace(".configuration_", ".modeling_")


def _rotate_function(module, config):
    """The module's own rotate function (`rotate_half`, or GPT-J's `rotate_every_two`) and its layout: "half" (channel
    i pairs with i + R/2: Llama's) or "interleaved" (channel 2i with 2i + 1: Cohere's, GLM's, GPT-J's)."""
    rotate = getattr(module, "rotate_half", None) or getattr(module, "rotate_every_two", None)
    if rotate is None:
        raise _refusal(config, f"{module.__name__} has no rotate_half to re-rotate its sink keys with")
    probe = torch.zeros(1, 1, 1, 4)
    probe[..., 0] = 1.0
    turned = rotate(probe)[0, 0, 0]  # channel 0 lands on its partner (with the sign the model's direction gives it)
    if turned[2] != 0 and turned[1] == 0:
        return rotate, "half"
    if turned[1] != 0 and turned[2] == 0:
        return rotate, "interleaved"
    raise _refusal(config, f"{module.__name__}.{rotate.__name__} pairs channels in a way the re-rotation does not know")


class KeyRotation:
    """RoPE's rotation by a number of positions, the model's own way: its `rotate_half` (rotate-half or interleaved
    pairs) on the first `rotary_dim` channels of each head, with its frequencies.

    `inv_freq` (`[rotary_dim / 2]`) is what the model's rotary embedding computes from its config (for a model with a
    RoPE per layer type, Gemma 3's, that layer type's): a key rotated at position p and then by `steps` is the key
    rotated at p + steps (RoPE's rotations compose; YaRN's attention factor scales a key once, when the model
    rotates it, and a rotation leaves that scale alone).
    """

    def __init__(self, inv_freq: torch.Tensor, rotate=rotate_half, layout: str = "half"):
        self.inv_freq = inv_freq.to(torch.float64)
        self.rotary_dim = 2 * inv_freq.numel()
        self.rotate, self.layout = rotate, layout

    @classmethod
    def from_config(cls, config, layer_type: str | None = None) -> KeyRotation:
        """The rotation of the layers of `layer_type` (None: the model's one RoPE), or a one-line `ValueError` where
        the model's keys cannot be moved by one rotation."""
        if getattr(config, "qk_rope_head_dim", None):  # multi-head latent attention: the rotated channels are last
            raise _refusal(config, "its keys are rotated on their last qk_rope_head_dim channels (multi-head latent "
                           "attention), which the re-rotation does not take")
        module, rotary_class = _rope_parts(config)
        rotate, layout = _rotate_function(module, config)
        try:
            rotary = rotary_class(config)
        except Exception as e:  # noqa: BLE001 - a config its rotary embedding cannot read
            raise _refusal(config, f"{rotary_class.__name__} cannot be built from the config ({type(e).__name__})") from None
        rope_type = getattr(rotary, "rope_type", "default")
        if isinstance(rope_type, dict):  # a RoPE per layer type
            rope_type = rope_type.get(layer_type or "full_attention", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise _refusal(config, f"rope_type {rope_type!r} changes its frequencies with the sequence length, so a "
                           "cached sink key cannot be moved by one rotation")
        inv_freq = getattr(rotary, f"{layer_type or 'full_attention'}_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise _refusal(config, f"{rotary_class.__name__} keeps a table of positions, no frequencies (inv_freq), so "
                           "a cached key cannot be rotated further")
        return cls(inv_freq, rotate, layout)

    def __call__(self, keys: torch.Tensor, steps: int) -> torch.Tensor:
        """`keys` `[B, H, S, D]` rotated `steps` positions further (fp32 arithmetic, float64 angles)."""
        angle = steps * self.inv_freq.to(keys.device)  # [rotary_dim / 2]
        if self.layout == "half":
            angle = torch.cat((angle, angle))  # [rotary_dim]: channel i pairs with i + rotary_dim / 2
        else:
            angle = angle.repeat_interleave(2)  # [rotary_dim]: channel 2i pairs with 2i + 1
        cos, sin = angle.cos().float(), angle.sin().float()
        head, rest = keys[..., : self.rotary_dim].float(), keys[..., self.rotary_dim :]
        rotated = head * cos + self.rotate(head) * sin
        return torch.cat((rotated.to(keys.dtype), rest), dim=-1)


class SinkLayer(DynamicLayer):
    """One attention layer's entries: the first `num_sink_tokens` and the most recent ones, `window_length` in all.

    `keys` / `values` (`[B, H, n, D]`, n <= window_length between forwards) hold the entries as the model
    rotated them; `update` hands attention the sinks rotated by the entries evicted after them (module doc).
    """

    is_croppable = False  # evicted entries are gone: assisted decoding cannot roll back

    def __init__(self, window_length: int, num_sink_tokens: int, rotation: KeyRotation | None):
        super().__init__()
        self.window_length = window_length
        self.num_sink_tokens = num_sink_tokens
        self.rotation = rotation
        self.cumulative_length = 0  # tokens seen: the next token's position (`reset` zeroes it)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        evicted = self.cumulative_length - self.stored_length()
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)  # [B, H, n + T, D]
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = self._window(keys), self._window(values)
        sinks = self.num_sink_tokens
        if evicted and sinks:
            keys = torch.cat([self.rotation(keys[..., :sinks, :], evicted), keys[..., sinks:, :]], dim=-2)
        return keys, values

    def _window(self, states: torch.Tensor) -> torch.Tensor:
        """`[B, H, n, D]` -> the sinks and the most recent entries, `window_length` at most."""
        if states.shape[-2] <= self.window_length:
            return states
        recent = self.window_length - self.num_sink_tokens
        return torch.cat([states[..., : self.num_sink_tokens, :], states[..., -recent:, :]], dim=-2)

    def stored_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized and self.keys.numel() else 0

    def get_seq_length(self) -> int:
        """Tokens seen, evicted ones included: generate() and the models count positions from it."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The entries and the new tokens, numbered from 0 (see the module doc, "Masks")."""
        return self.stored_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.window_length

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a SinkCache cannot be cropped: the entries it evicted are gone (no assisted decoding)")


class SinkCache(DynamicCache):
    """StreamingLLM's cache: the first `num_sink_tokens` entries and the most recent, `window_length` in all.

    Pass it as `past_key_values` to `generate()` or to a forward loop. `config` is the model's config: its
    layer types decide each layer's cache (full attention gets a `SinkLayer`, sliding and linear-attention
    layers what `DynamicCache(config=...)` gives them) and its RoPE the sinks' re-rotation. The module doc
    says how positions, masks and padding work.
    """

    def __init__(self, window_length: int, num_sink_tokens: int, config):
        def count(value) -> bool:  # an int, not a bool (True is an int to Python, and a window of 1 to the cache)
            return isinstance(value, int) and not isinstance(value, bool)

        if not count(window_length) or window_length < 1:
            raise ValueError(f"SinkCache: window_length must be a positive int, got {window_length!r}")
        if not count(num_sink_tokens) or not 0 <= num_sink_tokens < window_length:
            raise ValueError(
                f"SinkCache: num_sink_tokens must be an int from 0 to window_length - 1 ({window_length - 1}), "
                f"got {num_sink_tokens!r}"
            )
        super().__init__(config=config)
        text_config = config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        rotations = {}  # one per layer type: Gemma 3's full-attention layers have a RoPE of their own

        def sink_layer(index: int) -> SinkLayer:
            layer_type = layer_types[index] if len(layer_types) == len(self.layers) else None
            if num_sink_tokens and layer_type not in rotations:
                rotations[layer_type] = KeyRotation.from_config(text_config, layer_type)
            return SinkLayer(window_length, num_sink_tokens, rotations.get(layer_type))

        self.layers = [sink_layer(i) if type(layer) is DynamicLayer else layer for i, layer in enumerate(self.layers)]
        if not any(isinstance(layer, SinkLayer) for layer in self.layers):
            kinds = sorted(set(layer_types or ["?"]))
            raise ValueError(f"SinkCache: the model has no full-attention layer to window (its layers: {', '.join(kinds)})")
        self.window_length = window_length
        self.num_sink_tokens = num_sink_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the mask builders number the first new token: after a `SinkLayer`'s entries (module doc, "Masks")."""
        layers = self.layers
        if layer_idx == 0 and layers and not isinstance(layers[0], CacheLayerMixin):
            # a linear-attention layer 0: the mask builders are sized by the first attention layer (`get_mask_sizes`)
            layer_idx = next((i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)), 0)
        if layer_idx < len(layers) and isinstance(layers[layer_idx], SinkLayer):
            return layers[layer_idx].stored_length()
        return super().get_query_offset(layer_idx)

    def __repr__(self) -> str:
        return f"SinkCache(window_length={self.window_length}, num_sink_tokens={self.num_sink_tokens}, layers={len(self.layers)})"
