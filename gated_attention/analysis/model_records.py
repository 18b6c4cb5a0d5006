"""What transformers' `_can_record_outputs` declarations do not say, per model type or class, as data.

`layout.model_layout` reads a model through its declaration (the mechanism, read by `modeling/recorded_outputs.py`);
where a declaration does not say enough, a record here says what differs, and the layout picks it once, when it reads
the model. Nothing here is tested again inside a hook: the hooks call what was picked. The one record the declared
gate needs as well sit beside the reader in `modeling/recorded_outputs.py`: which declared attention classes compute no
softmax attention (`NOT_SOFTMAX`, MiniMax's lightning attention), the classes that predate the declaration
(`LEGACY_DECLARATIONS`: Bloom, Falcon, GPT-Neo, MPT, ...; their attention returns its weights only when the model is
called with `output_attentions=True`, which `Capture` then passes, `ModelLayout.weights_on_request`), and the model
types neither command reads (`REFUSED`: Reformer's chunks and hash buckets, MusicGen's audio codes, Gemma 4's
assistants).

Declarations completed or replaced:
- `UNDECLARED`: model types that declare nothing because they have no attention (Mamba, RWKV):
  their decoder layer is the class in `_no_split_modules`, and no module is attention.
- `PACKAGE_DECLARATIONS`: packages whose models declare nothing (fla): their decoder layer is the
  class in `_no_split_modules`, their attention the package's softmax-attention class.
- `PARALLEL_LAYERS`: model types whose layers are no modules (XLM: parallel lists of attention, norm and feed-forward
  modules): the list whose entry starts each layer and the one whose entry's output is the layer's output.
- `LOOPED`: model types whose layers run several times in one forward although their declared layer count
  counts modules, not calls (Dory's recurrent section): their layers are found in the order they run.
- `LAYER_TYPE_FIELDS`: the config fields that name each decoder layer's type.

Models refused, with the reason, in one line:
- `REQUIRED_FIELDS`: config fields a model needs set, have no default, and the analysis cannot choose (X-MOD's input
  language): a checkpoint without one is refused in one line that names the field and its choices.

How states and maps are read (`View`, one per model, picked by `view_of`):
- `VIEWS`: models whose residual state is not `[B, T, D]` over the input's tokens, or whose attention weights are not
  the `[B, H, T, T]` second output of their attention module: DeepSeek-V4's hyper-connection streams (reduced by the
  model's own head), CPM-Ant's prompt positions before the input, ProphetNet's n-gram streams after the main one,
  XLNet's time-major states. Every other model reads through the plain `View`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# ---------------------------------------------------------------- declarations completed or replaced

# transformers model types that declare no attention output, because they have no attention (xLSTM declares
# its hidden states only).
UNDECLARED = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
# Packages whose model classes declare nothing: the module of their softmax attention class.
PACKAGE_DECLARATIONS = {"fla": {"attentions": ("fla.layers.attn", "Attention")}}
# Model types whose layers are no modules: the base model holds parallel lists of per-layer modules and runs entry i of
# each in turn (XLM: attentions, layer_norm1, ffns, layer_norm2). The list whose entry i starts layer i + 1 (its
# attention, whose input is the layer's input) and the list whose entry i's output is that layer's output. XLM then
# multiplies that output by its padding mask in place, as its forward goes on: the capture reduces a residual state only
# when the next is read or the model's forward has returned, so it reads what transformers returns.
PARALLEL_LAYERS = {"xlm": ("attentions", "layer_norm2")}
# Model types whose decoder layers run several times in one forward while their config counts modules: the config
# field that counts the passes (a model with one pass runs each layer once). Those that count calls need no record.
LOOPED = {"dory": "n_recurrent_loops"}
# Config fields that name each decoder layer's type, in order of preference.
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type")

# ---------------------------------------------------------------- models refused

# Config fields a model type needs set and has no default for, which the analysis cannot choose for the user: the field,
# the config field that lists its choices, and what the model does with it. X-MOD runs one language adapter per layer,
# chosen by the input's language: transformers' own forward raises without one, and only the user knows the inputs'.
REQUIRED_FIELDS = {"xmod": ("default_language", "languages", "the language adapter every layer runs")}

# ---------------------------------------------------------------- how states and maps are read


class View:
    """How a decoder layer's residual state and an attention module's weights are read, as transformers returns
    them: `[B, T, D]` and `[B, H, T, T]` over the input's T tokens. The plain view: the state as the layer gives it,
    the weights as the second output of the attention module."""

    # Why an edit of the residual state cannot be written back into the model (None: it can); `--intervene` and
    # `interventions.apply_edits` refuse such a model with it.
    edit_refusal: str | None = None

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The state a layer passes on -> `[B, T, D]`."""
        return x

    def edited(self, x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The state the model continues with, given `new`, an edited `residual(x)`."""
        return new

    def weights(self, output, index: int = 1) -> torch.Tensor | None:
        """An attention module's output -> its weights `[B, H, T, T]`, item `index` of it as the model declares
        (`ModelLayout.weights_index`); None: it returned none."""
        weights = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
        return weights if isinstance(weights, torch.Tensor) and weights.dim() == 4 else None


class HyperConnections(View):
    """Decoder layers that pass several residual streams on (`[B, T, N, D]`, DeepSeek-V4's hyper-connections) and a
    module of the model's own (`hc_head`) that reduces them to one before the final norm: each state is read through
    it, as the model reads its last one."""

    edit_refusal = "it carries several residual streams (hyper-connections), and the intervention edits one"

    def __init__(self, head: nn.Module):
        self.head = head

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class PromptPrefix(View):
    """Learned prompt tokens before every input (CPM-Ant: `config.prompt_length` of them), which the model drops from
    the states and maps it returns: both are read past them, so token 0 is the input's first token."""

    edit_refusal = "it puts its prompt tokens before the first token, which the intervention edits"

    def __init__(self, length: int):
        self.length = length

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.length :]

    def weights(self, output, index: int = 1) -> torch.Tensor | None:
        weights = super().weights(output, index)
        return None if weights is None else weights[..., self.length :, self.length :]


class MainStream(View):
    """Prediction streams after the main one, `[B, (1 + n) T, D]` (ProphetNet's `config.ngram` n-gram streams): the
    residual is read as the main stream, the first T positions, as transformers returns it."""

    edit_refusal = "it carries several residual streams (n-gram streams), and the intervention edits one"

    def __init__(self, streams: int):
        self.streams = streams

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] // self.streams]


class TimeMajor(View):
    """States kept time-major (XLNet: `[T, B, D]`, weights `[T, T, B, H]` third in its attention's output, `(h, g,
    weights)`, g None without a target mapping): read in that layout and permuted as transformers permutes what it
    returns; an edit goes back the same way."""

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)  # [T, B, D] -> [B, T, D]

    def edited(self, x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new.transpose(0, 1)

    def weights(self, output, index: int = 1) -> torch.Tensor | None:  # XLNet declares none: its weights are third
        weights = output[2] if isinstance(output, (tuple, list)) and len(output) > 2 else None
        if not (isinstance(weights, torch.Tensor) and weights.dim() == 4):
            return None
        return torch.einsum("ijbn->bnij", weights)  # i query, j key, b batch, n head


def _hyper_connections(model: nn.Module) -> View | None:
    head = getattr(model, "hc_head", None)  # the text model's, not the causal LM's around it
    return HyperConnections(head) if isinstance(head, nn.Module) else None


def _prompt_prefix(model: nn.Module) -> View | None:
    length = getattr(model.config, "prompt_length", 0)
    return PromptPrefix(length) if length else None


# model type -> the view of a `PreTrainedModel` of that type (None where this submodel does not hold what it reads).
VIEWS: dict[str, Callable[[nn.Module], View | None]] = {
    "deepseek_v4": _hyper_connections,
    "hy_v4": _hyper_connections,
    "cpmant": _prompt_prefix,
    "prophetnet": lambda model: MainStream(1 + model.config.ngram),
    "xlnet": lambda model: TimeMajor(),
}


def view_of(models) -> View:
    """The view of a model, from its `PreTrainedModel`s (outer first): the first record that applies, else the plain
    `View`."""
    for model in models:
        pick = VIEWS.get(getattr(getattr(model, "config", None), "model_type", None))
        if pick is not None and (view := pick(model)) is not None:
            return view
    return View()
