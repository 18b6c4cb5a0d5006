"""What `export --format qwen3_5` writes for each engine, as records: the weight rules and the config layouts.

The weights are one layout for every engine (`QWEN3_5_WEIGHTS`, rules in the
manner of transformers' `conversion_mapping.py`); the config.json is one of two
(`CONFIG_LAYOUTS`). No one config serves every engine, because of the
tokenizer: transformers from 5.18 gives every folder whose model_type is
`qwen3_5` its own `Qwen3_5Tokenizer` (Qwen's normalizer and pre-tokenizer over
the saved vocabulary), whatever tokenizer was saved, and transformers, vLLM,
mlx-lm and llama.cpp's converter all read tokenizers that way; while mlx-lm
reads no other model_type.

`export` applies the records (`plan_export`, `_write_config`); adding an
engine's layout is adding a record here and its test. Also here: what mlx-lm
cannot run (`mlx_lm_limit`) and what the `qwen3_5` tokenizer does to SRC's
text (`qwen3_5_tokenizer_difference`), each said as a warning, not refused.
Standard library only at import: the CLI reads `LAYOUTS` for its choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURE = "Qwen3_5ForCausalLM"

# --- the weights: one Qwen3.5 text checkpoint, whatever the config layout ----------------------------------


@dataclass(frozen=True)
class WeightRule:
    """SRC tensors `<prefix><source>` -> one Qwen3.5 tensor `<prefix><target>`, made by `op`.

    Sources are name suffixes, matched with `str.endswith`. The first places the
    output: it is written where SRC has that tensor. The others travel with it
    and are not written on their own. The first rule whose first source
    matches applies; a tensor no rule matches is copied under its own name.
    The ops (`export.OPS`):
    - `copy`: the first source, unchanged;
    - `minus_one`: `w - 1`, checked exact (`1 + (w - 1) == w` in the stored dtype);
    - `concat`: the sources along dim 0, in order; every one must exist;
    - `q_with_gate`: per head, D query rows then D gate rows; a gate SRC lacks is zeros.
    """

    sources: tuple[str, ...]
    target: str | None = None  # default: the first source
    op: str = "copy"

    def output(self, prefix: str) -> str:
        return prefix + (self.target or self.sources[0])


@dataclass(frozen=True)
class ZeroFill:
    """A tensor Qwen3.5 expects where SRC may have none: zeros, written after `after` of the same layer."""

    target: str
    after: str


_QKV = ("q", "k", "v")

QWEN3_5_WEIGHTS = (
    # Qwen3.5's full attention is our G1 elementwise sigmoid gate with the gate's projection stored inside
    # q_proj (`[H * 2D, hidden]`, split by `chunk(2)` on a `[.., H, 2D]` view). A headwise or head-shared
    # score is the elementwise gate with repeated rows; q_proj's bias covers both halves, so a gate without
    # a bias gets zeros there.
    WeightRule(("self_attn.q_proj.weight", "self_attn.attn_gate.weight"), op="q_with_gate"),
    WeightRule(("self_attn.q_proj.bias", "self_attn.attn_gate.bias"), op="q_with_gate"),
    # Gated DeltaNet: one projection and one convolution for q, k and v, concatenated along dim 0 in this
    # order; the rest renamed. Its gated output norm keeps a plain weight (no 1 + w), so it comes before
    # the norms below.
    WeightRule(tuple(f"linear_attn.{x}_proj.weight" for x in _QKV), "linear_attn.in_proj_qkv.weight", op="concat"),
    WeightRule(tuple(f"linear_attn.{x}_conv1d.weight" for x in _QKV), "linear_attn.conv1d.weight", op="concat"),
    WeightRule(("linear_attn.g_proj.weight",), "linear_attn.in_proj_z.weight"),
    WeightRule(("linear_attn.a_proj.weight",), "linear_attn.in_proj_a.weight"),
    WeightRule(("linear_attn.b_proj.weight",), "linear_attn.in_proj_b.weight"),
    WeightRule(("linear_attn.o_norm.weight",), "linear_attn.norm.weight"),
    WeightRule(("linear_attn.o_proj.weight",), "linear_attn.out_proj.weight"),  # A_log and dt_bias keep their names
    # Every other RMSNorm (layer, final, q/k) multiplies by (1 + w), so a Llama-style weight w is stored as w - 1.
    WeightRule(("norm.weight",), op="minus_one"),
    # Every other tensor (embeddings, k/v/o projections, MLPs, lm_head): the same name and bytes. The empty
    # suffix matches every name, so this rule comes last.
    WeightRule(("",)),
    # Qwen2-style q/k/v biases without an o_proj bias: Qwen3.5 has one flag for all four, so o_proj gets a
    # zero bias (adding 0 is exact).
    ZeroFill("self_attn.o_proj.bias", after="self_attn.o_proj.weight"),
)


# --- the config: one record per layout, for the engines that read it ----------------------------------------


@dataclass(frozen=True)
class ConfigLayout:
    """One config.json for the same `Qwen3_5ForCausalLM` weights.

    The text model's config is transformers' `Qwen3_5TextConfig` (model_type
    `qwen3_5_text`). A layout with another `model_type` wraps it, as the config
    class of that model_type (`AutoConfig.for_model`) takes it, under `nested_under`.
    """

    name: str  # the --layout value
    engines: str  # who reads it, for the log
    model_type: str
    nested_under: str | None = None
    text_keys: dict[str, Callable[[list[str]], object]] = field(default_factory=dict)  # key -> its value from layer_types; None: left out
    outer_keys: tuple[str, ...] = ()  # the text model's keys the wrapper repeats at the top level
    qwen3_5_tokenizer: bool = False  # transformers >= 5.18 loads this folder's tokenizer as Qwen3_5Tokenizer

    def describe(self) -> str:
        nesting = f", the text model under {self.nested_under}" if self.nested_under else ""
        return f"model_type {self.model_type}{nesting}, for {self.engines}"


def full_attention_interval(layer_types: list[str]) -> int | None:
    """The k for which layer i (0-based) is full attention exactly when (i + 1) % k == 0, if one exists and k > 1.

    mlx-lm's Qwen3.5 builds its layers from this one number (`full_attention_interval`);
    the package's `hybrid_ratio` schedules are of this form, any trailing block included.
    """
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not full:
        return None
    k = full[0] + 1
    return k if k > 1 and full == list(range(k - 1, len(layer_types), k)) else None


CONFIG_LAYOUTS = {
    layout.name: layout
    for layout in (
        # The default, flat. transformers, vLLM and llama.cpp read model_type qwen3_5_text with the tokenizer as
        # saved and place layers by `layer_types`; mlx-lm does not know the type.
        ConfigLayout("text", engines="transformers, vLLM and llama.cpp", model_type="qwen3_5_text"),
        # The Hub's Qwen3.5 layout, the only one mlx-lm reads: the text model under text_config, plus the
        # `full_attention_interval` by which mlx-lm places its layers (it ignores `layer_types`; without an
        # interval the key is left out and `mlx_lm_limit` warns). transformers (5.17 on) loads it as the same
        # Qwen3_5ForCausalLM, and reads tied embeddings at both levels. Only a text model: no vision weights
        # are written, so the wrapper's vision fields (its defaults, which transformers writes too) describe
        # nothing here. The text is tokenized Qwen's way, which `export` says when that differs from SRC's.
        ConfigLayout(
            "mlx",
            engines="mlx-lm",
            model_type="qwen3_5",
            nested_under="text_config",
            text_keys={"full_attention_interval": full_attention_interval},
            outer_keys=("tie_word_embeddings",),
            qwen3_5_tokenizer=True,
        ),
    )
}
LAYOUTS = tuple(CONFIG_LAYOUTS)


# --- what an engine will make of the export: warned, not refused ----------------------------------------------


def mlx_lm_limit(layer_types: list[str], conv_kernel: int | None) -> str | None:
    """Why mlx-lm (0.32) cannot run a Qwen3.5 model with this schedule and convolution width, or None."""
    if "linear_attention" not in layer_types:
        return "mlx-lm's Qwen3.5 has no path for a model without Gated DeltaNet layers (this one is all attention)"
    if "full_attention" not in layer_types:
        return "mlx-lm's Qwen3.5 has no path for a model without full-attention layers (this one is all Gated DeltaNet)"
    if full_attention_interval(layer_types) is None:
        pattern = "".join("A" if kind == "full_attention" else "L" for kind in layer_types)
        return (f"mlx-lm places full attention at every full_attention_interval-th layer, and this schedule "
                f"({pattern}, A = attention) has no such interval")
    if conv_kernel == 1:
        # Its convolution state keeps the last kernel - 1 inputs as `x[:, -(kernel - 1):]`, which for 0 is all of x:
        # the first decoding step after the prompt then stops on a reshape.
        return "mlx-lm's Gated DeltaNet stops at the first decoding step with a convolution of width 1"
    return None


def llama_cpp_limit(layer_types: list[str], interval_written: int | None) -> str | None:
    """Why llama.cpp's GGUF converter before its PR #28208 would place this export's layers wrongly, or None.

    That converter writes only `full_attention_interval` (4 where the config has none) and ignores
    `layer_types`, and llama.cpp then makes layer i full attention exactly when (i + 1) % interval == 0;
    from PR #28208 on it writes each layer's kind from `layer_types`.
    """
    interval = interval_written or 4
    placed = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))]
    if placed == list(layer_types):
        return None
    pattern = "".join("A" if kind == "full_attention" else "L" for kind in layer_types)
    wrong = "".join("A" if kind == "full_attention" else "L" for kind in placed)
    written = f"it is {interval_written}" if interval_written else "this config has none, so it takes 4"
    return (f"llama.cpp's GGUF converter before its PR #28208 reads only full_attention_interval ({written}) and "
            f"ignores layer_types: it would load this schedule ({pattern}, A = attention) as {wrong}, silently "
            f"wrong; convert with a llama.cpp that has PR #28208")


# A few lines where pre-tokenizers disagree: contractions, digit runs, indentation and newlines, tabs,
# accents composed and combining, CJK.
TOKENIZER_SAMPLE = "Don't panic: 1234 apples,\n\n    def f(x):\treturn x ** 2  # caf\u00e9 cafe\u0301 \u6771\u4eac\n"


def qwen3_5_tokenizer_difference(folder: Path) -> str | None:
    """How the tokenizer of a `qwen3_5` folder differs from SRC's own, as one line, or None.

    transformers from 5.18 loads the tokenizer of a folder whose model_type is
    `qwen3_5` as `Qwen3_5Tokenizer` (Qwen3.5's normalizer and pre-tokenizer, the
    saved vocabulary and merges) whatever class was saved; mlx-lm reads tokenizers
    through transformers. Compared here on `TOKENIZER_SAMPLE`, on any version.
    """
    from transformers import AutoTokenizer, Qwen3_5Tokenizer

    if not (folder / "tokenizer.json").is_file():
        return None  # the comparison reads tokenizer.json; without one it says nothing
    own = AutoTokenizer.from_pretrained(folder)
    if isinstance(own, Qwen3_5Tokenizer):
        return None
    try:
        qwen = Qwen3_5Tokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - what stops it stops mlx-lm's tokenizer too: said, not raised
        return (f"with --layout mlx, mlx-lm (and transformers >= 5.18) load this tokenizer as Qwen3_5Tokenizer, "
                f"which cannot read it ({type(e).__name__}: {' '.join(str(e).split())})")
    a, b = own(TOKENIZER_SAMPLE)["input_ids"], qwen(TOKENIZER_SAMPLE)["input_ids"]
    if a == b and len(own) == len(qwen):
        return None
    return (f"with --layout mlx, mlx-lm (and transformers >= 5.18) tokenize text with Qwen3.5's pre-tokenizer "
            f"instead of this {type(own).__name__}'s ({len(a)} vs {len(b)} tokens on a sample, vocabulary "
            f"{len(own)} vs {len(qwen)}): give mlx-lm token ids, or its tokenizer as "
            f"PreTrainedTokenizerFast.from_pretrained(DST) (README, Serve)")
