"""The gate's sigmoid in bf16: two ways to round it, against transformers' Qwen3.5 and exact arithmetic.

Two ways to compute `y * sigmoid(z)` on bf16 tensors:

  bf16 sigmoid   `y * torch.sigmoid(z)`: the sigmoid rounded to bf16, then the product rounded
                 (transformers' Qwen3-Next and Qwen3.5, and vLLM's);
  fp32 sigmoid   `(y * torch.sigmoid(z.float())).to(bf16)`: one rounding, of the product
                 (Megatron-LM's attention output gate, the fused kernel's epilogue, and this package's
                 `apply_gate`: the script checks that it is this one, bit for bit).

Part "op": the gate alone on the same bf16 inputs (y an attention output, z the logits of a sparse gate,
mean score about 0.2): each output and the gradients of y and z (same upstream gradient) against the same
maths in float64 on those inputs, as relative RMS error and the worst error in bf16 ulps; and the share of
outputs equal bit for bit to transformers' formula.

Part "train": a 2-layer G1 model trained under bf16 autocast (float32 weights, as accelerate's
mixed_precision="bf16") from the same init on the same random batches, against the run in float32: the final loss's difference and how far the parameters moved apart.

Part "layer": Qwen3.5's full-attention layer (transformers' `Qwen3_5Attention`) and ours (G1 elementwise,
q/k norms, the same weights) in bf16, against ours in float32: the layer's output and the gate projection's
weight gradient, as relative RMS error, and the share of outputs equal to transformers' bit for bit.

Usage: python benchmarks/gate_precision.py [--tokens 65536 --seq 256 --seeds 3]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

import gated_attention.modeling.attention as attention_module
from gated_attention import GatedAttentionConfig, GatedAttentionForCausalLM
from gated_attention.cli_common import OneLineErrorParser, bounded
from gated_attention.kernels.gated_sdpa.gate_activations import apply_gate

BF16 = torch.bfloat16


def gate_bf16(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return y * torch.sigmoid(z)


def gate_fp32(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return (y * torch.sigmoid(z.float())).to(y.dtype)


WAYS = {"bf16 sigmoid": gate_bf16, "fp32 sigmoid": gate_fp32}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref).norm() / ref.norm())


def worst_ulps(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |x - ref| in units of bf16's spacing at ref (2^(exponent - 7))."""
    spacing = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    return float(((x.detach().double() - ref).abs() / spacing).max())


def op_part(tokens: int, seed: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(tokens, 128, generator=g) * 0.5).to(BF16)
    z = (torch.randn(tokens, 128, generator=g) * 2 - 1.5).to(BF16)  # sigmoid mean ~0.27, a sparse gate
    upstream = torch.randn(tokens, 128, generator=g).to(BF16)
    y64, z64 = y.double().requires_grad_(), z.double().requires_grad_()
    exact = y64 * torch.sigmoid(z64)
    exact.backward(upstream.double())
    theirs = gate_bf16(y, z)
    rows = {}
    for name, way in WAYS.items():
        yy, zz = y.clone().requires_grad_(), z.clone().requires_grad_()
        out = way(yy, zz)
        out.backward(upstream)
        rows[name] = {
            "out rel RMS": rel_rms(out, exact.detach()),
            "out worst ulps": worst_ulps(out, exact.detach()),
            "dz rel RMS": rel_rms(zz.grad, z64.grad),
            "dy rel RMS": rel_rms(yy.grad, y64.grad),
            "equal to transformers": float((out == theirs).double().mean()),
        }
    return rows


@contextlib.contextmanager
def gate_way(way):
    """Run our model with `way` as its gate (the model calls `apply_gate` for multiplicative sigmoid gates)."""
    original = attention_module.apply_gate

    def patched(y, logits, activation, mode="multiplicative"):
        assert activation == "sigmoid" and mode == "multiplicative"
        return way(y, logits)

    attention_module.apply_gate = patched
    try:
        yield
    finally:
        attention_module.apply_gate = original


def layer_part(seq: int, seed: int) -> dict[str, dict[str, float]]:
    H, HKV, D, HID = 8, 2, 64, 512
    torch.manual_seed(seed)
    theirs = Qwen3_5Attention(
        Qwen3_5TextConfig(hidden_size=HID, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D,
                          num_hidden_layers=1, layer_types=["full_attention"], attn_implementation="sdpa"),
        layer_idx=0,
    )
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=HID**-0.5)
    model = GatedAttentionForCausalLM(GatedAttentionConfig(
        vocab_size=8, hidden_size=HID, intermediate_size=8, num_hidden_layers=1, num_attention_heads=H,
        num_key_value_heads=HKV, head_dim=D, qk_norm=True, attn_implementation="sdpa"))
    ours = model.model.layers[0].self_attn
    q_and_gate = theirs.q_proj.weight.view(H, 2, D, HID)  # Qwen3.5 interleaves [query D | gate D] per head
    with torch.no_grad():
        ours.q_proj.weight.copy_(q_and_gate[:, 0].reshape(H * D, HID))
        ours.attn_gate.weight.copy_(q_and_gate[:, 1].reshape(H * D, HID))
        for name in ("k_proj", "v_proj", "o_proj"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
        ours.q_norm.weight.copy_(1 + theirs.q_norm.weight)
        ours.k_norm.weight.copy_(1 + theirs.k_norm.weight)
    x = torch.randn(2, seq, HID)
    upstream = torch.randn(2, seq, HID)
    cos_sin = model.model.rotary_emb(x, torch.arange(seq)[None])

    def run(module, dtype, gate_weight):
        module.to(dtype).zero_grad()
        out, _ = module(x.to(dtype), position_embeddings=tuple(c.to(dtype) for c in cos_sin), attention_mask=None)
        out.backward(upstream.to(dtype))
        return out.detach().float(), gate_weight().grad.float()

    ref_out, ref_grad = run(ours, torch.float32, lambda: ours.attn_gate.weight)
    ref_out, ref_grad = ref_out.double(), ref_grad.double()
    theirs_out, grad = run(theirs, BF16, lambda: theirs.q_proj.weight)
    grad = grad.view(H, 2, D, HID)[:, 1].reshape(H * D, HID)
    rows = {"transformers Qwen3.5": {"out rel RMS": rel_rms(theirs_out, ref_out),
                                     "gate dW rel RMS": rel_rms(grad, ref_grad), "equal to transformers": 1.0}}
    for name, way in WAYS.items():
        with gate_way(way):
            out, grad = run(ours, BF16, lambda: ours.attn_gate.weight)
        rows[f"ours, {name}"] = {"out rel RMS": rel_rms(out, ref_out), "gate dW rel RMS": rel_rms(grad, ref_grad),
                                 "equal to transformers": float((out == theirs_out).double().mean())}
        ours.to(torch.float32)
    return rows


def train_part(steps: int, seed: int) -> dict[str, dict[str, float]]:
    """A 2-layer G1 model trained under bf16 autocast (AdamW, random tokens) against the same run in float32."""
    config = GatedAttentionConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, head_dim=32, attn_implementation="sdpa")
    torch.manual_seed(seed)
    init = GatedAttentionForCausalLM(config).state_dict()
    batches = [torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(seed * 1000 + i))
               for i in range(steps)]

    def train(autocast: bool):
        model = GatedAttentionForCausalLM(config)
        model.load_state_dict(init)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        params = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        return float(loss.detach()), params

    ref_loss, ref_params = train(autocast=False)
    rows = {}
    for name, way in WAYS.items():
        with gate_way(way):
            loss, params = train(autocast=True)
        rows[f"ours, {name}"] = {"final loss - fp32's": loss - ref_loss,
                                 "params rel distance to fp32's": rel_rms(params, ref_params)}
    return rows


def mean_rows(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {name: {key: sum(run[name][key] for run in runs) / len(runs) for key in runs[0][name]} for name in runs[0]}


def show(title: str, rows: dict[str, dict[str, float]]) -> None:
    keys = list(next(iter(rows.values())))
    print(f"\n{title}\n| way | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.3g}" for k in keys) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=bounded(int, 1), default=65536, help="rows of the op part (x 128 channels)")
    parser.add_argument("--seq", type=bounded(int, 1), default=256, help="tokens per row of the layer part (2 rows)")
    parser.add_argument("--steps", type=bounded(int, 1), default=50, help="training steps of the train part")
    parser.add_argument("--seeds", type=bounded(int, 1), default=3, help="runs averaged")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    y, z = torch.randn(2, 4096).to(BF16)
    ours = [name for name, way in WAYS.items() if torch.equal(apply_gate(y, z, "sigmoid"), way(y, z))]
    print(f"the package's apply_gate is: {', '.join(ours) or 'neither'}")
    show(f"op: y * sigmoid(z), {args.tokens} x 128, mean of {args.seeds} seeds, against float64 on the same inputs",
         mean_rows([op_part(args.tokens, seed) for seed in range(args.seeds)]))
    show(f"train: {args.steps} AdamW steps of a 2-layer G1 model under bf16 autocast, mean of {args.seeds} seeds, against the "
         "same run in float32", mean_rows([train_part(args.steps, seed) for seed in range(args.seeds)]))
    show(f"layer: Qwen3.5 full attention, 2 x {args.seq} tokens, hidden 512, 8 heads of 64, mean of {args.seeds} "
         "seeds, against ours in float32", mean_rows([layer_part(args.seq, seed) for seed in range(args.seeds)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
