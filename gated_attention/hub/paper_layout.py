"""The Gated Attention paper's released checkpoints: their layout, read from config.json and the q_proj shape.

The paper's authors released 1B models trained with their own code
(github.com/qiuzh20/gated_attention, `configuration_qwen3.py` and
`modeling_qwen3.py`; Hub repo `QwQZh/gated_attention`, one folder per model).
Their config.json says `model_type: "qwen3"` and adds four flags that no
transformers Qwen3 config has:

- `headwise_attn_output_gate` / `elementwise_attn_output_gate`: a sigmoid gate
  on each head's SDPA output before `o_proj`, one score per head or per
  channel (headwise wins where both are set, as in their code);
- `use_qk_norm` (default true): RMSNorm on q and k per head, as Qwen3's;
- `qkv_bias`: a bias on q, k, v *and* o alike (their code never reads
  `attention_bias`); their code has no default for it, so a config without
  it is read as having none, and the weights then decide (a bias tensor
  would have no place).

The gate scores come out of `q_proj`, packed per key/value group: for group
g come the query rows of its heads (G * D rows, G = heads per group), then its
gate rows (G for headwise, G * D for elementwise):

    q_proj rows = [q(g=0) | gate(g=0) | q(g=1) | gate(g=1) | ...]

`PaperLayout.rows` deals those rows out to this package's `q_proj` and
`attn_gate`, whose heads run in the same order (head h belongs to group
h // G in both). Their code is never run here; tests/test_paper_layouts.py
checks this reading against outputs their code produced (tests/paper_reference.py).

Standard library only, but for `split_state` (torch, imported there).
"""

from __future__ import annotations

from dataclasses import dataclass

FLAGS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "use_qk_norm", "qkv_bias")
DEFAULTS = dict(headwise_attn_output_gate=False, elementwise_attn_output_gate=False, use_qk_norm=True, qkv_bias=False)
NAME = "Gated Attention paper"


def is_paper_config(config: dict) -> bool:
    """A config.json written by the paper's code: model type qwen3 with one of its flags. A plain Qwen3 has none."""
    return config.get("model_type") == "qwen3" and any(flag in config for flag in FLAGS)


def unsupported(config: dict) -> str | None:
    """What the paper's checkpoint says that this package cannot read exactly, or None."""
    for flag in FLAGS:
        if flag in config and not isinstance(config[flag], bool):
            return f"{flag} = {config[flag]!r} is a {type(config[flag]).__name__}, expected true or false"
    if config.get("use_sliding_window"):
        # Their eager and SDPA attention ignore the window; only their flash-attention 2 path applies it.
        return ("use_sliding_window=true: the paper's code windows attention only under flash-attention 2, so "
                "the model's outputs depend on the kernel it ran with")
    return None


@dataclass(frozen=True)
class PaperLayout:
    """How one of the paper's checkpoints lays out its attention."""

    granularity: str | None  # "headwise", "elementwise", or None: the baseline, no gate
    qk_norm: bool
    bias: bool  # on q, k, v and o (and so on the gate rows, which are q_proj's)
    num_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict) -> PaperLayout:
        flags = {**DEFAULTS, **{k: config[k] for k in FLAGS if k in config}}
        heads = config["num_attention_heads"]
        granularity = ("headwise" if flags["headwise_attn_output_gate"]
                       else "elementwise" if flags["elementwise_attn_output_gate"] else None)
        return cls(
            granularity=granularity,
            qk_norm=flags["use_qk_norm"],
            bias=flags["qkv_bias"],
            num_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )

    @property
    def group(self) -> int:
        """Query heads per key/value group."""
        return self.num_heads // self.num_key_value_heads

    @property
    def gate_width(self) -> int:
        """Gate rows per key/value group."""
        return {"headwise": self.group, "elementwise": self.group * self.head_dim, None: 0}[self.granularity]

    @property
    def q_proj_rows(self) -> int:
        return self.num_key_value_heads * (self.group * self.head_dim + self.gate_width)

    def gate_spec(self) -> dict | None:
        """The gate as this package's spec (`config.attn_gate`): G1, sigmoid, multiplicative, per head."""
        if self.granularity is None:
            return None
        return {"position": "sdpa", "granularity": self.granularity, "bias": self.bias}

    def target_fields(self) -> dict:
        """This package's config fields that the paper's flags set, but for the gate (`gate_spec`, which `convert
        --gate` may add to the baseline); the others keep Qwen3's names. `convert`'s record and `analyze` read
        these."""
        return dict(qk_norm=self.qk_norm, attention_bias=self.bias, qkv_bias=False)

    def rows(self) -> dict[str, list[int]]:
        """q_proj's rows dealt out: {"q_proj": query rows, "attn_gate": gate rows}; no gate, no "attn_gate"."""
        queries, per_group = self.group * self.head_dim, self.group * self.head_dim + self.gate_width
        out = {"q_proj": [g * per_group + i for g in range(self.num_key_value_heads) for i in range(queries)]}
        if self.gate_width:
            out["attn_gate"] = [g * per_group + queries + i for g in range(self.num_key_value_heads)
                                for i in range(self.gate_width)]
        return out

    def describe(self) -> str:
        kind = f"{self.granularity} gate" if self.granularity else "no gate"
        return (f"the paper's layout with {kind}: {self.num_heads} heads of {self.head_dim} in "
                f"{self.num_key_value_heads} key/value group(s); q_proj packs per group {self.group * self.head_dim} "
                f"query rows then {self.gate_width} gate rows, {self.q_proj_rows} in all")

    def parts(self, name: str, rows: int) -> dict[str, list[int]] | None:
        """The paper's one weight rule: a packed `*.self_attn.q_proj.weight` or `.bias` of `rows` rows as {this
        package's tensor name: its rows of it} (`rows()`: the query rows to q_proj, the gate rows to attn_gate);
        None for every other tensor, which is ours as it is. `convert` applies it to its plan (`plan.SplitRows`),
        `analyze` to the tensors it loads (`split_state`). Raises `LayoutMismatch` for rows this layout does not
        pack."""
        if not name.endswith((".self_attn.q_proj.weight", ".self_attn.q_proj.bias")):
            return None
        if rows != self.q_proj_rows:
            raise LayoutMismatch(f"tensor {name} has {rows} rows, and {self.describe()}: config.json and the weights "
                                 "disagree")
        stem, suffix = name.rsplit("q_proj", 1)
        return {f"{stem}{part}{suffix}": part_rows for part, part_rows in self.rows().items()}

    def split_state(self, tensors) -> dict:
        """`parts` at load time: (name, tensor) pairs as read from the checkpoint -> our state dict."""
        import torch

        state = {}
        for name, tensor in tensors:
            parts = self.parts(name, tensor.shape[0])
            if parts is None:
                state[name] = tensor
            else:
                state.update({part: tensor.index_select(0, torch.tensor(rows)) for part, rows in parts.items()})
        return state


class LayoutMismatch(ValueError):
    """config.json and a weight of the paper's checkpoint disagree (the message says how)."""
