"""Model-level GPU figures: what a user of `attn_implementation="sdpa"` or `"gated_triton"` actually gets.

Parts (all by default, or pick with --parts), bf16 weights built directly on the GPU:

    train     one training step (forward, loss, backward; no optimizer) of an 8-layer `dense-1.7b`-shaped
              model, B x T = 2 x 4096: the ungated baseline and G1 with "sdpa", G1 with "gated_triton";
              milliseconds and tokens/s, and gated_triton / sdpa
    generate  greedy `generate` tokens/s (B = 1, 512-token prompt, 128 new tokens), "sdpa" against
              "gated_triton"
    agree     bf16 agreement of "gated_triton" with "sdpa" on the same model and input (B x T = 1 x 1024):
              max|logits difference| and each path's max error against the fp32 "sdpa" logits; greedy tokens
              equal (32 new tokens); gradients' relative difference ||g_triton - g_sdpa|| / ||g_sdpa||
    compile   torch.compile(model, fullgraph=True) with "gated_triton" (a graph break raises, and is
              printed), then its training step against eager, on a 2-layer model of the same shape
    hybrid    training step of an 8-layer `gdn-1.3b-3to1`-shaped hybrid (fla's kernels for the Gated DeltaNet
              layers, a G1 gate on full attention) against transformers' Qwen3.5 of the same shape
    moe       training step of a 4-layer `moe-15b-a2.5b`-shaped MoE, B x T = 1 x 4096, "sdpa" and
              "gated_triton"

Each part catches its own errors and prints them, so one failure does not hide the other figures; the
exit status is 1 if any part failed. Timings: triton.testing.do_bench (median) on the GPU.

On a machine without CUDA the script prints "no CUDA: skipped" and exits 0; `--smoke` runs every part
with tiny models on the CPU ("gated_triton" runs its torch reference there; compile uses the "eager"
backend), which checks the script, not the speed.

Usage: python benchmarks/gpu_models.py [--parts train generate agree compile hybrid moe] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from gated_attention.cli_common import OneLineErrorParser

PARTS = ("train", "agree", "generate", "moe", "hybrid", "compile")
IMPLEMENTATIONS = ("sdpa", "gated_triton")


class Setup:
    """Sizes and device for a run: the GPU figures, or tiny ones on the CPU (--smoke)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.dtype = torch.float32 if smoke else torch.bfloat16
        if smoke:
            tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16)
            self.dense = dict(tiny, num_hidden_layers=2)
            self.hybrid = dict(tiny, num_hidden_layers=3, linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16)
            self.moe = dict(tiny, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
            self.train_shape, self.moe_shape, self.agree_shape = (2, 32), (1, 32), (1, 32)
            self.prompt, self.new_tokens, self.agree_tokens, self.compile_layers = 16, 4, 4, 1
        else:
            self.dense = dict(num_hidden_layers=8)
            self.hybrid = dict(num_hidden_layers=8)
            self.moe = dict(num_hidden_layers=4)
            self.train_shape, self.moe_shape, self.agree_shape = (2, 4096), (1, 4096), (1, 1024)
            self.prompt, self.new_tokens, self.agree_tokens, self.compile_layers = 512, 128, 32, 2

    def dense_config(self, preset="dense-1.7b", **overrides):
        from gated_attention import GatedAttentionConfig

        return GatedAttentionConfig.from_preset(preset, **{**self.dense, **overrides})

    def build(self, model_class, config, implementation="sdpa", dtype=None):
        """The model built on the device, in the run's dtype, with `implementation` set."""
        torch.manual_seed(0)
        with torch.device(self.device):
            model = model_class(config)
        model = model.to(dtype or self.dtype)
        model.set_attn_implementation(implementation)
        return model

    def ids(self, shape, vocab_size):
        return torch.randint(0, vocab_size, shape, device=self.device)

    def time_ms(self, fn, params=()) -> float:
        """Median milliseconds of fn, after one untimed call (compilation, autotuning)."""
        fn()
        if self.device == "cuda":
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=200, grad_to_none=list(params), return_mode="median")
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]


def train_step(model, ids):
    """forward, loss (the model's causal LM loss, MoE auxiliary losses included), backward."""

    def step():
        model(ids, labels=ids).loss.backward()

    return step


def report_train(setup, label, model, ids, baseline_ms=None) -> float:
    model.train()
    ms = setup.time_ms(train_step(model, ids), model.parameters())
    tokens = ids.numel() / (ms / 1e3)
    versus = f"  {ms / baseline_ms:.3f}x the first row" if baseline_ms else ""
    print(f"  {label:<44} {ms:9.2f} ms  {tokens:10.0f} tokens/s{versus}", flush=True)
    model.zero_grad(set_to_none=True)
    return ms


# --- parts -----------------------------------------------------------------------------------------------


def part_train(setup):
    from gated_attention import GatedAttentionForCausalLM

    B, T = setup.train_shape
    layers = setup.dense_config().num_hidden_layers
    print(f"train: {layers}-layer dense-1.7b shape, B x T = {B} x {T}, forward + loss + backward", flush=True)
    ids = None
    rows = [("dense-1.7b-baseline", "sdpa"), ("dense-1.7b", "sdpa"), ("dense-1.7b", "gated_triton")]
    first = None
    for preset, implementation in rows:
        model = setup.build(GatedAttentionForCausalLM, setup.dense_config(preset), implementation)
        ids = setup.ids((B, T), model.config.vocab_size) if ids is None else ids
        ms = report_train(setup, f"{preset}, {implementation}", model, ids, first)
        first = first or ms
        del model
        empty_cache(setup)


def part_generate(setup):
    from gated_attention import GatedAttentionForCausalLM

    model = setup.build(GatedAttentionForCausalLM, setup.dense_config()).eval()
    prompt = setup.ids((1, setup.prompt), model.config.vocab_size)
    n = setup.new_tokens
    layers = model.config.num_hidden_layers
    print(f"generate: {layers}-layer dense-1.7b shape (G1), B = 1, prompt {setup.prompt}, {n} new tokens, greedy",
          flush=True)
    for implementation in IMPLEMENTATIONS:
        model.set_attn_implementation(implementation)

        def run():
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)

        ms = setup.time_ms(run) if setup.device == "cpu" else cuda_time_ms(run)
        print(f"  {implementation:<14} {ms:9.1f} ms  {n / (ms / 1e3):8.1f} new tokens/s", flush=True)


def cuda_time_ms(fn, repeats=3) -> float:
    """Median wall milliseconds of a host-heavy call (generate), synchronised, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def part_agree(setup):
    from gated_attention import GatedAttentionForCausalLM

    B, T = setup.agree_shape
    config = setup.dense_config()
    dtype = str(setup.dtype).removeprefix("torch.")
    print(f"agree: {config.num_hidden_layers}-layer dense-1.7b shape (G1), B x T = {B} x {T}, {dtype} "
          f"\"gated_triton\" against \"sdpa\"", flush=True)
    reference = setup.build(GatedAttentionForCausalLM, config, "sdpa", dtype=torch.float32).eval()
    ids = setup.ids((B, T), config.vocab_size)
    with torch.no_grad():
        ref_logits = reference(ids).logits.float()
    del reference
    empty_cache(setup)

    model = setup.build(GatedAttentionForCausalLM, config)
    logits, grads, tokens = {}, {}, {}
    prompt = ids[:, : min(T, 128)]
    for implementation in IMPLEMENTATIONS:
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[implementation] = out.logits.detach().float()
        grads[implementation] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            tokens[implementation] = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=setup.agree_tokens,
                min_new_tokens=setup.agree_tokens, do_sample=False, pad_token_id=0,
            )[0, prompt.shape[1]:]
    scale = ref_logits.abs().max().item()
    diff = (logits["gated_triton"] - logits["sdpa"]).abs().max().item()
    print(f"  max|logits(gated_triton) - logits(sdpa)| = {diff:.3e}   (max|logits| {scale:.3g})")
    for implementation in IMPLEMENTATIONS:
        err = (logits[implementation] - ref_logits).abs().max().item()
        print(f"  max|logits({implementation}) - logits(fp32 sdpa)| = {err:.3e}")
    same = torch.equal(tokens["gated_triton"], tokens["sdpa"])
    where = (tokens["gated_triton"] != tokens["sdpa"]).nonzero()
    first = "" if same else f" (first difference at new token {where[0, 0].item()})"
    print(f"  greedy tokens equal over {setup.agree_tokens} new tokens: {same}{first}")
    num = sum((grads["gated_triton"][n] - g).square().sum() for n, g in grads["sdpa"].items()).sqrt()
    den = sum(g.square().sum() for g in grads["sdpa"].values()).sqrt()
    worst = max(grads["sdpa"], key=lambda n: ((grads["gated_triton"][n] - grads["sdpa"][n]).norm()
                                              / grads["sdpa"][n].norm().clamp_min(1e-30)).item())
    worst_rel = ((grads["gated_triton"][worst] - grads["sdpa"][worst]).norm() / grads["sdpa"][worst].norm()).item()
    print(f"  gradients: ||g_triton - g_sdpa|| / ||g_sdpa|| = {(num / den).item():.3e} over all parameters; "
          f"worst single parameter {worst}: {worst_rel:.3e}", flush=True)


def part_compile(setup):
    from gated_attention import GatedAttentionForCausalLM

    B, T = setup.train_shape
    layers = setup.compile_layers
    backend = "eager" if setup.smoke else "inductor"
    print(f"compile: torch.compile(model, fullgraph=True, backend={backend!r}), \"gated_triton\", {layers}-layer "
          f"dense-1.7b shape, B x T = {B} x {T}", flush=True)
    model = setup.build(GatedAttentionForCausalLM, setup.dense_config(num_hidden_layers=layers), "gated_triton")
    model.train()
    ids = setup.ids((B, T), model.config.vocab_size)
    eager_ms = report_train(setup, "eager", model, ids)
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    start = time.perf_counter()
    try:
        train_step(compiled, ids)()
    except Exception as error:  # noqa: BLE001 - fullgraph=True raises on the first graph break
        lines = str(error).strip().splitlines()
        print(f"  fullgraph compile FAILED ({type(error).__name__}): a graph break or an untraceable op:")
        print("\n".join(f"    {line}" for line in lines[:25]), flush=True)
        raise
    seconds = time.perf_counter() - start
    print(f"  fullgraph compile: no graph break (first step, compilation included: {seconds:.1f} s)")
    report_train(setup, "compiled", compiled, ids, eager_ms)


def part_hybrid(setup):
    from gated_attention import GatedDeltaNetHybridConfig, GatedDeltaNetHybridForCausalLM

    B, T = setup.train_shape
    overrides = dict(setup.hybrid, attn_gate={"position": "sdpa"})  # Qwen3.5 gates its full attention (G1)
    if setup.smoke:
        config = GatedDeltaNetHybridConfig(hybrid_ratio="2:1", **overrides)
    else:
        config = GatedDeltaNetHybridConfig.from_preset("gdn-1.3b-3to1", **overrides)
    full = config.layer_types.count("full_attention")
    print(f"hybrid: {config.num_hidden_layers}-layer gdn-1.3b-3to1 shape with a G1 gate ({full} full-attention "
          f"layers), B x T = {B} x {T}, training step", flush=True)
    ids = setup.ids((B, T), config.vocab_size)
    first = None
    for implementation in IMPLEMENTATIONS:
        model = setup.build(GatedDeltaNetHybridForCausalLM, config, implementation)
        ms = report_train(setup, f"gated_attention hybrid, {implementation}", model, ids, first)
        first = first or ms
        del model
        empty_cache(setup)
    try:
        from transformers import Qwen3_5ForCausalLM

        from gated_attention.convert.export import qwen3_5_config

        native = qwen3_5_config(config)
    except Exception as error:  # noqa: BLE001 - an older transformers has no Qwen3.5
        print(f"  transformers Qwen3.5: not constructible here ({type(error).__name__}: {error})")
        return
    model = setup.build(Qwen3_5ForCausalLM, native, "sdpa")
    if setup.smoke:  # transformers routes Qwen3.5 to fla's kernels whenever fla imports; they need a GPU
        from gated_attention.convert.export import qwen3_5_torch_path

        with qwen3_5_torch_path():
            report_train(setup, "transformers Qwen3_5ForCausalLM, sdpa", model, ids, first)
    else:
        report_train(setup, "transformers Qwen3_5ForCausalLM, sdpa", model, ids, first)


def part_moe(setup):
    from gated_attention import GatedAttentionMoeConfig, GatedAttentionMoeForCausalLM

    B, T = setup.moe_shape
    if setup.smoke:
        config = GatedAttentionMoeConfig(**setup.moe)
    else:
        config = GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b", **setup.moe)
    print(f"moe: {config.num_hidden_layers}-layer moe-15b-a2.5b shape ({config.num_experts} experts, top "
          f"{config.num_experts_per_tok}), B x T = {B} x {T}, training step", flush=True)
    ids = setup.ids((B, T), config.vocab_size)
    first = None
    for implementation in IMPLEMENTATIONS:
        model = setup.build(GatedAttentionMoeForCausalLM, config, implementation)
        ms = report_train(setup, f"G1 elementwise, {implementation}", model, ids, first)
        first = first or ms
        del model
        empty_cache(setup)


def empty_cache(setup):
    if setup.device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script, not speed")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_models benchmark: no CUDA: skipped (--smoke runs it tiny on the CPU)")
        return 0
    setup = Setup(args.smoke)
    import transformers

    where = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    failed = []
    for name in args.parts:
        start = time.perf_counter()
        try:
            globals()[f"part_{name}"](setup)
        except Exception:  # noqa: BLE001 - report and go on to the next part
            failed.append(name)
            print(f"  part {name} FAILED:\n{traceback.format_exc(limit=8)}", flush=True)
        print(f"  ({name}: {time.perf_counter() - start:.1f} s)\n", flush=True)
        empty_cache(setup)
    print(f"gpu_models: {'all parts ran' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
