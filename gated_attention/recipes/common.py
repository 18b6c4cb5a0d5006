"""What both recipes share: where they run (`Placement`), the run itself (`Job`), and the model pairs."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import CLIError
from ..training import data
from ..training.threads import set_cpu_threads

# ---------------------------------------------------------------------------------------------
# Device


@dataclass(frozen=True)
class Placement:
    """Where the job runs: parameters are fp32 everywhere; on a GPU the training forwards run under bf16 autocast.

    Evaluation always runs in fp32, so every column of the table measures the same fp32 model on any device.
    """

    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32

    def describe(self) -> str:
        if self.autocast_dtype is None:
            return f"{self.device.type} (fp32)"
        return (f"{self.device.type} (training under {dtype_name(self.autocast_dtype)} autocast, fp32 parameters; "
                "fp32 evaluation)")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def choose_device(requested: str) -> Placement:
    """`--device auto|cpu|cuda`: auto is cuda when torch sees a GPU; cuda trains under bf16 autocast."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return Placement(torch.device("cpu"), None)
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False); use --device cpu")
        return Placement(torch.device("cuda"), torch.bfloat16)
    raise CLIError(f"--device {requested!r}: choose auto, cpu or cuda")


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Job:
    """One recipe run: its output folder, cache, placement, progress bars, log and clock."""

    out: Path
    cache: Path
    placement: Placement
    progress: bool
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, args: argparse.Namespace, settings: dict) -> Job:
        """Read the run's flags (`--out`, `--cache`, `--device`, `--threads`, `--no-progress`), create the
        output folder and write `settings.json` (the recipe's settings and where it ran)."""
        placement = choose_device(getattr(args, "device", None) or "auto")
        # On a GPU torch's CPU threads do little; there only an explicit --threads changes them.
        threads = ""
        if placement.device.type == "cpu" or getattr(args, "threads", None):
            count, why = set_cpu_threads(getattr(args, "threads", None))
            threads = f"; {count} torch thread(s) ({why})"
        cache = Path(args.cache).expanduser() if getattr(args, "cache", None) else data.cache_dir()
        job = cls(Path(args.out), cache, placement, progress=not getattr(args, "no_progress", False))
        job.out.mkdir(parents=True, exist_ok=True)
        where = {"device": placement.device.type, "autocast": dtype_name(placement.autocast_dtype),
                 "threads": torch.get_num_threads()}
        (job.out / "settings.json").write_text(json.dumps({**settings, **where}, indent=1), encoding="utf-8")
        job.log(f"device: {placement.describe()}{threads}")
        return job

    def log(self, message: str) -> None:
        print(message, flush=True)  # flushed: a background run's log is read while it runs

    def minutes(self) -> float:
        return (time.perf_counter() - self.started) / 60


# ---------------------------------------------------------------------------------------------
# Models


def model_shape(s, tokenizer) -> dict:
    """Config fields shared by every model of a recipe (`s`: `Settings` or `SinkSettings`): Llama's names."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads, max_position_embeddings=s.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def model_pair(s, tokenizer, architecture: str = "dense", hybrid_ratio: int = 3):
    """An ungated model and the same model with the G1 gate: identical weights apart from the gates.

    Dense: `GatedAttentionForCausalLM`. Hybrid: `GatedDeltaNetHybridForCausalLM`
    at the massive-activations paper's `hybrid_ratio`:1 (every `hybrid_ratio`-th layer full
    attention), the GDN layers as wide as the attention (`num_attention_heads`
    heads of `head_dim` keys and `2 * head_dim` values); only the
    full-attention layers differ.
    """
    shape = model_shape(s, tokenizer)
    if architecture == "dense":
        from ..configuration.gated_attention import GatedAttentionConfig as Config
        from ..modeling.gated_attention import GatedAttentionForCausalLM as Model
    else:
        from ..configuration.gated_deltanet_hybrid import GatedDeltaNetHybridConfig as Config
        from ..modeling.gated_deltanet_hybrid import GatedDeltaNetHybridForCausalLM as Model

        head_dim = s.hidden_size // s.num_attention_heads
        shape.update(hybrid_ratio=hybrid_ratio, linear_num_key_heads=s.num_attention_heads,
                     linear_key_head_dim=head_dim, linear_value_head_dim=2 * head_dim)
    torch.manual_seed(s.seed)
    ungated = Model(Config(**shape, attn_gate=None))
    torch.manual_seed(s.seed)
    gated = Model(Config(**shape, attn_gate={"position": "G1"}))
    missing, unexpected = gated.load_state_dict(ungated.state_dict(), strict=False)
    assert not unexpected and all("attn_gate" in k for k in missing), (missing, unexpected)
    return ungated, gated
