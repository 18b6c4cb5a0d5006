"""The source families, one record each: what a family's config.json means and how its weights map onto ours.

A record (`Family`) is data, as mergekit keeps an architecture and as
transformers' `conversion_mapping.py` declares renames and fusions:

- `defaults`: the transformers class's defaults, for the keys config.json
  leaves out (transformers saves only what differs from them);
- `aliases`: keys the class reads under another name (its `attribute_map`);
- `derived`: the fields the class works out in `__post_init__`;
- `default_theta`, `rope`: how the class standardises its RoPE fields;
- `target`: our config's fields that are fixed for the family, or read from
  another source field (`From`);
- `reader`: what reads its config.json (`source_config.SourceConfig`, the
  transformers classes' way; `source_config.FlaHybridSource`, fla's);
- `unsupported`: what our model cannot express exactly, refused in one line;
- `rules`: the weight rules, applied in order (`plan.Rename`, `plan.Split`,
  `plan.FuseExperts`, ..., and `plan.AddGate`, the gate the conversion adds);
- `matches`: for a record that shares its model type with another (the
  paper's checkpoints say "qwen3"), what in config.json tells it apart;
- `gate`: for a source that carries a gate of its own, that gate (kept, and
  `--gate` may only repeat it); `reference`: how transformers runs SRC for
  the verification, or that it cannot.

Adding a family is adding a record here and its test. The code that reads a
record is the record's `reader` (config.json), `targets` (our config) and
`plan` (the weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..hub import paper_layout
from .plan import AddGate, FuseExperts, Rename, RenameByLayerType, Split, SplitRows
from .source_config import GATED_MODEL_TYPES, FlaHybridSource, SourceConfig
from .sources import ConversionError


@dataclass(frozen=True)
class From:
    """A target field read from this source field (Mixtral's `num_local_experts` is our `num_experts`)."""

    field: str


@dataclass(frozen=True)
class Family:
    """A convertible source family."""

    name: str  # shown to users
    model_types: tuple[str, ...]
    kind: str  # "dense", "moe" or "hybrid": which of our configs it maps onto
    defaults: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)
    derived: tuple[Callable, ...] = ()  # each sets fields on the read config, in order
    default_theta: float = 1e4
    rope: Callable | None = None  # the class's own `convert_rope_params_to_dict`, where it overrides the mixin's
    target: dict | Callable[..., dict] = field(default_factory=dict)  # or source config -> those fields
    reader: Callable = SourceConfig  # (config.json as a dict, this record) -> the source config the rest reads
    unsupported: tuple[Callable, ...] = ()  # each: source config -> the reason it cannot convert exactly, or None
    rules: tuple = ()  # `plan.Rule`s, applied in this order
    matches: Callable[[dict], bool] | None = None  # None: its model types alone say it is this family
    gate: Callable | None = None  # source config -> its own gate spec (None: it has none); None: no gate of its own
    # source config -> from_pretrained overrides that make transformers' class for the model type run SRC
    # exactly, or None where no transformers class can (then the verification says so and is skipped)
    reference: Callable = lambda source: {}

    def __str__(self) -> str:
        return self.name


# --- derived fields (the classes' __post_init__) ------------------------------------------------------


def _window_only_if_used(c) -> None:
    """Qwen: a window size is kept in config.json even with use_sliding_window=false; it then means nothing."""
    if not c.use_sliding_window:
        c.sliding_window = None


def _window_from_max_window_layers(c) -> None:
    """Qwen2/3: layers from `max_window_layers` on are windowed, unless `layer_types` says otherwise."""
    if c.layer_types is None:
        c.layer_types = [
            "sliding_attention" if c.sliding_window is not None and i >= c.max_window_layers else "full_attention"
            for i in range(c.num_hidden_layers)
        ]


def _no_mlp_only_layers(c) -> None:
    if c.mlp_only_layers is None:
        c.mlp_only_layers = []


# --- what our models cannot express -------------------------------------------------------------------


def _whole_head_rope(c) -> str | None:
    factor = c.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        return f"partial_rotary_factor={factor:g} (the dense model's RoPE rotates the whole head, as with 1.0)"
    return None


def _fla_features(src: FlaHybridSource) -> str | None:
    """What an fla Gated DeltaNet config may ask for that our hybrid has not."""
    r = src.raw
    if not r["use_short_conv"]:
        return "use_short_conv=false (the Gated DeltaNet layer here always has its short convolutions)"
    if r["allow_neg_eigval"]:
        return "allow_neg_eigval=true (beta in [0, 2]) is not implemented by the hybrid model"
    if r["use_gate"] and r["output_gate_activation"] not in ("swish", "silu"):
        return f"output_gate_activation={r['output_gate_activation']!r} (only swish/silu)"
    if r["attnres_block_size"] is not None:
        return "attention residuals (attnres_block_size) are not implemented by the hybrid model"
    if r["hidden_act"] not in ("swish", "silu"):
        return f"hidden_act={r['hidden_act']!r} (only swish/silu)"
    if src.attn.get("qk_norm"):
        return "attn.qk_norm=true"  # fla's get_attention never passes it on; refuse rather than guess
    return None


def _phi3_rope(fields, rope_kwargs: dict) -> None:
    """Phi3Config.convert_rope_params_to_dict, the class's own: legacy `rope_scaling` replaces `rope_parameters`,
    the partial rotary factor moves into it, and the legacy "su" / "yarn" types are Phi-3's "longrope".

    The one family whose class is imported (which costs seconds): releases order these steps differently (5.25 renames the type
    before standardising, which then takes the top-level `original_max_position_embeddings` over the one in
    `rope_scaling`; 5.24 after, keeping it), so only the installed class says what it reads.
    """
    from transformers.models.phi3.configuration_phi3 import Phi3Config

    Phi3Config.convert_rope_params_to_dict(fields, **rope_kwargs)


# --- the paper's own checkpoints (`hub.paper_layout`) ---------------------------------------------------


def _paper(c) -> paper_layout.PaperLayout:
    return paper_layout.PaperLayout.from_config(vars(c))


def _paper_unsupported(c) -> str | None:
    return paper_layout.unsupported(vars(c))


def _paper_reference(c) -> dict | None:
    """transformers' Qwen3 runs the baseline exactly when it norms q and k (it always does), with its
    `attention_bias` for the paper's `qkv_bias` (both: q, k, v and o); the gate in q_proj, nothing there runs."""
    layout = _paper(c)
    if layout.granularity is not None or not layout.qk_norm:
        return None
    return {"attention_bias": layout.bias}


def _paper_parts(c, name: str, rows: int) -> dict[str, list[int]] | None:
    return _paper(c).parts(name, rows)


def _paper_fields(c) -> dict:
    return _paper(c).target_fields()


# --- the records --------------------------------------------------------------------------------------

_LLAMA_LIKE = dict(
    hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
    attention_dropout=0.0, head_dim=None, pad_token_id=None,
)  # fmt: skip
_QWEN = dict(
    _LLAMA_LIKE, vocab_size=151936, max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
_QWEN3 = dict(
    _QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, attention_bias=False, max_window_layers=28, layer_types=None,
)  # fmt: skip
# The gate every conversion adds: after the attention, before `self_attn.o_proj` (doubled for --init exact).
GATE = AddGate("self_attn.o_proj.weight", "self_attn.attn_gate")
# Per-expert tensors (the layout transformers 5 still saves for Qwen3-MoE and Mixtral) fused into our MoE's.
_MOE = dict(
    num_experts_per_tok=From("num_experts_per_tok"), output_router_logits=From("output_router_logits"),
    router_aux_loss_coef=From("router_aux_loss_coef"),
)  # fmt: skip

FAMILIES = (
    Family(
        "Llama", ("llama",), "dense",
        defaults=dict(
            _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, bos_token_id=1,
            eos_token_id=2, attention_bias=False, mlp_bias=False,
        ),
        rules=(GATE,),
    ),
    Family(
        "Mistral", ("mistral",), "dense",
        defaults=dict(
            _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, bos_token_id=1,
            eos_token_id=2, sliding_window=4096,
        ),
        rules=(GATE,),
    ),
    Family(
        "Qwen2/Qwen2.5", ("qwen2",), "dense",
        defaults=dict(
            _QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, max_window_layers=28, layer_types=None,
        ),
        derived=(_window_only_if_used, _window_from_max_window_layers),
        target=dict(qkv_bias=True),  # bias on q/k/v, none on o_proj
        rules=(GATE,),
    ),
    Family(
        # Before Qwen3: its config.json says "qwen3" too, and its flags tell it apart.
        paper_layout.NAME, ("qwen3",), "dense",
        matches=paper_layout.is_paper_config,
        defaults=dict(_QWEN3, **paper_layout.DEFAULTS),  # their Qwen3Config's are Qwen3's, plus the flags'
        derived=(_window_only_if_used, _window_from_max_window_layers),
        target=_paper_fields,
        unsupported=(_paper_unsupported,),
        gate=lambda c: _paper(c).gate_spec(),
        reference=_paper_reference,
        # q_proj's query and gate rows to q_proj and attn_gate; the gate then, where --gate asks for one
        # on the baseline (a kept gate is there already, and AddGate makes none).
        rules=(SplitRows(_paper_parts), GATE),
    ),
    Family(
        "Qwen3", ("qwen3",), "dense",
        defaults=_QWEN3,
        derived=(_window_only_if_used, _window_from_max_window_layers),
        target=dict(qk_norm=True),
        rules=(GATE,),
    ),
    Family(
        "Qwen3-MoE", ("qwen3_moe",), "moe",
        defaults=dict(
            _QWEN, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
            num_key_value_heads=4, attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=768,
            num_experts_per_tok=8, num_experts=128, norm_topk_prob=False, output_router_logits=False,
            router_aux_loss_coef=0.001, mlp_only_layers=None,
        ),
        aliases={"num_local_experts": "num_experts"},
        derived=(_window_only_if_used, _no_mlp_only_layers),
        target=dict(
            _MOE, qk_norm=True, num_experts=From("num_experts"), moe_intermediate_size=From("moe_intermediate_size"),
            norm_topk_prob=From("norm_topk_prob"), decoder_sparse_step=From("decoder_sparse_step"),
            mlp_only_layers=From("mlp_only_layers"),
        ),
        rules=(FuseExperts(), GATE),
    ),
    Family(
        "Mixtral", ("mixtral",), "moe",
        defaults=dict(
            _LLAMA_LIKE, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, sliding_window=None, num_experts_per_tok=2, num_local_experts=8,
            output_router_logits=False, router_aux_loss_coef=0.001,
        ),
        aliases={"num_experts": "num_local_experts"},
        default_theta=1e6,
        # Every layer sparse, experts as wide as intermediate_size, top-k weights renormalised.
        target=dict(
            _MOE, num_experts=From("num_local_experts"), moe_intermediate_size=From("intermediate_size"),
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_scores_fp32=True,
        ),
        rules=(
            Rename(r"\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$", r".mlp.experts.\1.gate_proj.weight"),
            Rename(r"\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$", r".mlp.experts.\1.up_proj.weight"),
            Rename(r"\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$", r".mlp.experts.\1.down_proj.weight"),
            Rename(r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
            FuseExperts(),
            GATE,
        ),
    ),
    Family(
        "Phi-3", ("phi3",), "dense",
        defaults=dict(
            _LLAMA_LIKE, vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=4096, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=32000, pad_token_id=32000, sliding_window=None,
            original_max_position_embeddings=4096,  # longrope's: standardising RoPE moves it into rope_parameters
        ),
        rope=_phi3_rope,
        # Phi3Attention and Phi3MLP have no bias, whatever config.json says. resid_pdrop / embd_pdrop are
        # dropout, which our model has not: they change training only, never the logits, so are not read.
        target=dict(attention_bias=False, mlp_bias=False),
        unsupported=(_whole_head_rope,),
        rules=(
            # q rows, then k, then v; the MLP's gate rows, then up (Phi3MLP: `chunk(2)`, gate first).
            Split("self_attn.qkv_proj.weight",
                  ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
            Split("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
            GATE,
        ),
    ),
    Family(
        # fla's `gated_deltanet` with an `attn` layer list (M-A-P's hybrids).
        "fla Gated DeltaNet hybrid", ("gated_deltanet",), "hybrid",
        defaults=dict(  # fla's GatedDeltaNetConfig
            hidden_size=2048, expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
            head_dim=256, num_heads=6, num_v_heads=None, max_position_embeddings=2048, hidden_ratio=4,
            intermediate_size=None, hidden_act="swish", num_hidden_layers=21, norm_eps=1e-6, attn=None, use_cache=True,
            pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.02,
            vocab_size=32000, attnres_block_size=None, output_gate_activation="swish",
        ),
        reader=FlaHybridSource,
        unsupported=(_fla_features,),
        rules=(
            Rename(r"^model\.embeddings\.weight$", "model.embed_tokens.weight"),
            Rename(r"^(model\.layers\.\d+)\.attn_norm\.", r"\1.input_layernorm."),
            Rename(r"^(model\.layers\.\d+)\.mlp_norm\.", r"\1.post_attention_layernorm."),
            RenameByLayerType("attn", attention="self_attn", linear="linear_attn"),
            GATE,
        ),
    ),
)  # fmt: skip

# The defaults by model type (tests/test_convert_source_config.py checks them against transformers' classes).
SOURCE_DEFAULTS = {t: f.defaults for f in FAMILIES if f.reader is SourceConfig and f.matches is None for t in f.model_types}
FLA_GDN_DEFAULTS = next(f.defaults for f in FAMILIES if f.reader is FlaHybridSource)
# Our own checkpoints (`extend`): gated already, and transformers saves an MoE's experts per expert too.
GATED_RULES = (FuseExperts(),)


def supported_list() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES if f.matches is None)


def family_record(config_dict: dict) -> Family | None:
    """The record that reads a config.json, or None. Records only: asking them costs nothing, while the declared
    route's question (`declared.declared_model_type`) builds transformers' table of every model type."""
    model_type = config_dict.get("model_type")
    return next((f for f in FAMILIES if model_type in f.model_types and (f.matches is None or f.matches(config_dict))),
                None)


def detect_family(config_dict: dict) -> Family:
    if (family := family_record(config_dict)) is not None:
        return family
    model_type = config_dict.get("model_type")
    if model_type in GATED_MODEL_TYPES:
        raise ConversionError(f"SRC is already a gated model ({model_type}); use `gated-attention extend` to change its RoPE")
    arch = ", ".join(config_dict.get("architectures") or []) or "none listed"
    raise ConversionError(
        f"unsupported architecture: model_type={model_type!r} (architectures: {arch}); supported: {supported_list()}, "
        "and by declaration any causal LM this transformers ships"
    )
