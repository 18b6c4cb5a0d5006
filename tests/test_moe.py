"""The MoE family against transformers' Qwen3-MoE / Qwen2-MoE and hand-written loss formulas."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from gated_attention import (
    GatedAttentionConfig,
    GatedAttentionForCausalLM,
    GatedAttentionMoeConfig,
    GatedAttentionMoeForCausalLM,
    GlobalLoadBalancer,
)
from gated_attention.modeling.load_balancing import load_balancing_loss, router_z_loss
from gated_attention.modeling.moe import SparseMoeBlock

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 dense: both kinds of MLP are covered
)


def tiny_model(**overrides) -> GatedAttentionMoeForCausalLM:
    return GatedAttentionMoeForCausalLM(GatedAttentionMoeConfig(**{**TINY, **overrides})).eval()


def padded_batch(batch: int, length: int, pad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and a left-padding mask with `pad[b]` padding tokens in row b."""
    ids = torch.randint(3, TINY["vocab_size"], (batch, length))
    mask = torch.ones_like(ids)
    for row, n in enumerate(pad):
        mask[row, :n] = 0
    return ids, mask


# --- hand-written references (float64, plain loops) --------------------------------------------------


def _real_token_probs(router_logits, mask):
    """Softmax probabilities of every real token of every layer, as lists of floats."""
    mask = mask.reshape(-1).tolist()
    for logits in router_logits:
        for token, real in zip(logits.double().tolist(), mask):
            if real:
                total = sum(math.exp(z) for z in token)
                yield [math.exp(z) / total for z in token]


def hand_f(router_logits, mask, top_k: int) -> list[float]:
    """f_e: the fraction of (layer, real token) rows whose top-k holds expert e."""
    rows = list(_real_token_probs(router_logits, mask))
    f = [0.0] * len(rows[0])
    for probs in rows:
        for e in sorted(range(len(probs)), key=lambda e: -probs[e])[:top_k]:
            f[e] += 1
    return [x / len(rows) for x in f]


def hand_p(router_logits, mask) -> list[float]:
    """P_e: the mean router probability of expert e over (layer, real token) rows."""
    rows = list(_real_token_probs(router_logits, mask))
    return [sum(probs[e] for probs in rows) / len(rows) for e in range(len(rows[0]))]


def hand_load_balancing(router_logits, mask, top_k: int) -> float:
    """E * sum_e f_e P_e, f and P pooled over layers and real tokens."""
    f, p = hand_f(router_logits, mask, top_k), hand_p(router_logits, mask)
    return len(f) * sum(a * b for a, b in zip(f, p))


def hand_z_loss(router_logits, mask) -> float:
    mask = mask.reshape(-1).tolist()
    values = [
        math.log(sum(math.exp(z) for z in token)) ** 2
        for logits in router_logits
        for token, real in zip(logits.double().tolist(), mask)
        if real
    ]
    return sum(values) / len(values)


# --- gate off: transformers' Qwen3-MoE with the same weights -------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_gate_off_matches_qwen3_moe(norm_topk_prob):
    shape = dict(TINY)
    source = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**shape, norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.1, output_router_logits=True)
    ).eval()
    shape["num_local_experts"] = shape.pop("num_experts")  # the name transformers 5 writes for Qwen3-MoE
    ours = GatedAttentionMoeForCausalLM(
        GatedAttentionMoeConfig(
            **shape,
            norm_topk_prob=norm_topk_prob,
            router_aux_loss_coef=0.1,
            output_router_logits=True,
            attn_gate=None,
            qk_norm=True,
            rope_parameters=dict(source.config.rope_parameters),
        )
    ).eval()
    assert ours.config.num_experts == 8
    ours.load_state_dict(source.state_dict(), strict=True)

    ids, mask = padded_batch(2, 9, pad=[0, 3])  # padding must be left out of the aux loss
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, labels=ids)
        got = ours(ids, attention_mask=mask, labels=ids)
    # fp32 and the same ops in the same order (both models pick the same attention and experts kernels): 1e-5 is
    # float rounding headroom, far below what one wrong weight or routing decision would change.
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.router_logits, expected.router_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)  # z-loss coefficient is 0 by default


def test_shared_expert_matches_qwen2_moe_block():
    shape = dict(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
    source = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**shape, shared_expert_intermediate_size=24, norm_topk_prob=True))
    for p in source.parameters():  # Qwen2-MoE leaves experts uninitialised outside a PreTrainedModel
        torch.nn.init.normal_(p, std=0.2)
    ours = SparseMoeBlock(
        GatedAttentionMoeConfig(**shape, num_attention_heads=4, shared_expert_intermediate_size=24, norm_topk_prob=True)
    )
    ours.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), source(x), rtol=1e-6, atol=1e-6)


# --- router losses against the hand formulas -----------------------------------------------------------


def test_router_losses_equal_hand_formulas():
    logits = tuple(torch.randn(10, 6) * 2 for _ in range(3))  # 3 layers, 10 tokens, 6 experts
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0, 1, 1])
    lbl = load_balancing_loss(logits, top_k=2, token_mask=mask)
    assert lbl.item() == pytest.approx(hand_load_balancing(logits, mask, 2), rel=1e-6)
    # ... and transformers' own function on the same logits.
    assert lbl.item() == pytest.approx(load_balancing_loss_func(logits, 6, 2, mask[None]).item(), rel=1e-6)
    assert router_z_loss(logits, mask).item() == pytest.approx(hand_z_loss(logits, mask), rel=1e-6)


def test_z_loss_is_added_with_its_own_coefficient():
    model = tiny_model(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    ids, mask = padded_batch(2, 7, pad=[2, 0])
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
        model.config.router_z_loss_coef = 0.25
        with_z = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert plain.z_loss.item() == pytest.approx(hand_z_loss(plain.router_logits, mask), rel=1e-6)
    assert with_z.loss.item() == pytest.approx(plain.loss.item() + 0.25 * plain.z_loss.item(), rel=1e-6)


# --- global-batch load balancing ------------------------------------------------------------------------


def test_global_balancer_over_two_micro_batches_equals_the_concatenated_batch():
    model = tiny_model(router_aux_loss_coef=1.0)
    ids, mask = padded_batch(4, 8, pad=[0, 5, 1, 0])  # the micro-batches hold different numbers of real tokens
    full = model(ids, attention_mask=mask, output_router_logits=True)
    params = [p for p in model.parameters() if p.requires_grad]
    full_grads = torch.autograd.grad(full.aux_loss, params, allow_unused=True)
    assert full.aux_loss.item() == pytest.approx(hand_load_balancing(full.router_logits, mask, 2), rel=1e-6)

    balancer = GlobalLoadBalancer.from_config(model.config, deferred=True)
    for rows in (slice(0, 2), slice(2, 4)):
        out = model(ids[rows], attention_mask=mask[rows], output_router_logits=True, load_balancer=balancer)
        assert out.aux_loss.item() == 0.0  # deferred: the micro-batch contributes through balancer.loss()
    accumulated = balancer.loss()
    # Same fp32 numbers summed in a different grouping: agreement to float rounding (1e-6 / 1e-5 relative).
    assert accumulated.item() == pytest.approx(full.aux_loss.item(), rel=1e-6)
    for p, a, b in zip(params, torch.autograd.grad(accumulated, params, allow_unused=True), full_grads):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)

    # A per-micro-batch local loss is a different number: the point of the global batch.
    local = [
        model(ids[rows], attention_mask=mask[rows], output_router_logits=True).aux_loss.item()
        for rows in (slice(0, 2), slice(2, 4))
    ]
    assert abs(sum(local) / 2 - full.aux_loss.item()) > 1e-4


def test_streaming_balancer_uses_the_counts_of_the_step_so_far():
    logits_1 = tuple(torch.randn(6, 5) for _ in range(2))
    logits_2 = tuple(torch.randn(8, 5) for _ in range(2))
    mask_1, mask_2 = torch.ones(6), torch.tensor([1.0, 1, 0, 1, 1, 1, 0, 1])
    balancer = GlobalLoadBalancer(num_experts=5, top_k=2)
    first = balancer(logits_1, mask_1)
    second = balancer(logits_2, mask_2)
    # The first micro-batch sees only itself; the second the counts of both and its own probabilities.
    assert first.item() == pytest.approx(hand_load_balancing(logits_1, mask_1, 2), rel=1e-6)
    both = tuple(torch.cat(pair) for pair in zip(logits_1, logits_2))
    f = hand_f(both, torch.cat([mask_1, mask_2]), 2)
    p = hand_p(logits_2, mask_2)
    assert second.item() == pytest.approx(5 * sum(a * b for a, b in zip(f, p)), rel=1e-6)
    # The exact value of the step is the concatenated batch's.
    assert balancer.loss().item() == pytest.approx(hand_load_balancing(both, torch.cat([mask_1, mask_2]), 2), rel=1e-6)
    balancer.reset()
    assert balancer(logits_2, mask_2).item() == pytest.approx(hand_load_balancing(logits_2, mask_2, 2), rel=1e-6)


# Each rank is a fresh interpreter that loads the balancer's module by path: it needs torch alone, and importing
# the package (transformers and all) twice would cost more than the rest of this file.
DATA_PARALLEL_WORKER = """
import importlib.util, sys
import torch, torch.distributed as dist

module_path, rank, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = importlib.util.spec_from_file_location("load_balancing", module_path)
load_balancing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(load_balancing)

dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
balancer = load_balancing.GlobalLoadBalancer(num_experts=5, top_k=2)
out, leaves = {"stream": []}, []
for micro_batch in torch.load(f"{folder}/data.pt")["micro_batches"][rank]:
    logits = tuple(z.clone().requires_grad_(True) for z in micro_batch["logits"])
    leaves.extend(logits)
    out["stream"].append(balancer(logits, micro_batch["mask"]).item())
share = balancer.loss()
out["share"], out["grads"] = share.item(), list(torch.autograd.grad(share, leaves))
torch.save(out, f"{folder}/rank{rank}.pt")
dist.destroy_process_group()
"""


def test_global_balancer_sums_counts_over_data_parallel_ranks(tmp_path):
    # Two ranks (gloo, CPU) with two micro-batches each and different numbers of real tokens per rank.
    def micro_batch(rows, pad):
        mask = torch.ones(rows)
        mask[:pad] = 0
        return {"logits": tuple(torch.randn(rows, 5) for _ in range(2)), "mask": mask}

    data = {"micro_batches": [[micro_batch(6, 1), micro_batch(4, 0)], [micro_batch(7, 3), micro_batch(5, 0)]]}
    torch.save(data, tmp_path / "data.pt")
    (tmp_path / "worker.py").write_text(DATA_PARALLEL_WORKER)
    module_path = inspect.getfile(GlobalLoadBalancer)
    command = [sys.executable, str(tmp_path / "worker.py"), module_path]
    workers = [
        subprocess.Popen([*command, str(rank), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in range(2)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=300)
        assert worker.returncode == 0, output.decode()
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    everything = [mb for rank in data["micro_batches"] for mb in rank]
    all_logits = tuple(torch.cat([mb["logits"][layer] for mb in everything]) for layer in range(2))
    all_mask = torch.cat([mb["mask"] for mb in everything])
    expected = hand_load_balancing(all_logits, all_mask, 2)
    # Each rank holds a share; their mean (what DDP averages) is the global-batch loss ...
    assert (results[0]["share"] + results[1]["share"]) / 2 == pytest.approx(expected, rel=1e-6)
    # ... and so is the gradient: d(global)/d(logits of rank r) = (1/W) d(share_r)/d(logits of rank r).
    leaves = tuple(z.clone().requires_grad_(True) for z in all_logits)
    global_grads = torch.autograd.grad(load_balancing_loss(leaves, 2, all_mask), leaves)
    offset = 0
    for rank in range(2):
        rank_grads = results[rank]["grads"]
        for i, mb in enumerate(data["micro_batches"][rank]):
            rows = mb["mask"].numel()
            for layer in range(2):
                torch.testing.assert_close(
                    rank_grads[2 * i + layer] / 2, global_grads[layer][offset : offset + rows], rtol=1e-5, atol=1e-8
                )
            offset += rows
    # Streaming: the second micro-batch of a step sees the counts of all four, and its P over both ranks.
    second = [data["micro_batches"][r][1] for r in range(2)]
    f = hand_f(all_logits, all_mask, 2)
    second_logits = tuple(torch.cat([mb["logits"][layer] for mb in second]) for layer in range(2))
    p = hand_p(second_logits, torch.cat([mb["mask"] for mb in second]))
    mean_stream = (results[0]["stream"][1] + results[1]["stream"][1]) / 2
    assert mean_stream == pytest.approx(5 * sum(a * b for a, b in zip(f, p)), rel=1e-6)


# --- generation, checkpointing, saving ------------------------------------------------------------------


def test_greedy_generate_with_cache_equals_recomputation():
    model = tiny_model(shared_expert_intermediate_size=24, eos_token_id=None)  # G1 gate on; all 8 tokens generated
    prompt = torch.randint(3, TINY["vocab_size"], (1, 6))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
        ids = prompt
        for _ in range(8):  # no cache: rerun the whole sequence every step
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(cached, ids)


def test_gradient_checkpointing_gives_the_same_gradients_with_router_losses():
    ids = torch.randint(0, TINY["vocab_size"], (2, 10))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = tiny_model(router_z_loss_coef=0.01).train()
        if checkpointing:
            model.gradient_checkpointing_enable()  # activation_checkpointing_enable from 5.24 on
        model(ids, labels=ids, output_router_logits=True).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert "model.layers.0.mlp.gate.weight" in grads[0]  # the router is trained through the losses
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


def test_no_split_modules_names_the_decoder_layer():
    model = tiny_model()
    assert set(model._no_split_modules) == {type(layer).__name__ for layer in model.model.layers}


def test_a_model_whose_class_fsdp_swapped_saves_its_own_remote_code(tmp_path):
    """FSDP2's `fully_shard` (which transformers 5.19 applies under `tp_size` with `ep_size`) swaps a module's class
    for an `FSDP<name>` subclass made in torch's module; saving then bundled torch's module, and failed."""
    model = tiny_model()
    model.save_pretrained(tmp_path / "plain")
    for module in (model, model.model):
        cls = type(module)
        module.__class__ = type(f"FSDP{cls.__name__}", (cls,), {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"})
    model.save_pretrained(tmp_path / "swapped")
    plain, swapped = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("plain", "swapped"))
    assert swapped["auto_map"] == plain["auto_map"] and swapped["architectures"] == plain["architectures"]
    assert sorted(p.name for p in (tmp_path / "swapped").glob("*.py")) == sorted(p.name for p in (tmp_path / "plain").glob("*.py"))


def test_remote_code_bundle_loads_without_the_package(tmp_path, run_without_package):
    model = tiny_model(shared_expert_intermediate_size=24, attn_gate={"position": "G1", "granularity": "headwise"})
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    assert {"configuration_gated_attention_moe.py", "modeling_gated_attention_moe.py", "modeling_moe.py"} <= {
        p.name for p in folder.glob("*.py")
    }
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(loaded, GatedAttentionMoeForCausalLM)
    ids, mask = padded_batch(2, 8, pad=[0, 2])
    with torch.no_grad():
        # From the loaded copy, as the remote-code run's: weights read from the file can sit at an address that is
        # not 64-byte aligned, and the CPU matmul then rounds differently (up to 7e-9 here) than on the model's own.
        out = loaded(ids, attention_mask=mask, output_router_logits=True)
        torch.save({"ids": ids, "mask": mask, "logits": out.logits, "aux": out.aux_loss}, tmp_path / "expected.pt")
    out = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        try:
            import gated_attention
        except ImportError:
            pass
        else:
            raise SystemExit("gated_attention should not be importable here")
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__name__ == "GatedAttentionMoeForCausalLM", type(model)
        assert "gated_attention" not in type(model).__module__.split(".")[0]
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            out = model(expected["ids"], attention_mask=expected["mask"], output_router_logits=True)
        assert torch.equal(out.logits, expected["logits"]), (out.logits - expected["logits"]).abs().max()
        assert torch.equal(out.aux_loss, expected["aux"])
        print("ok", type(model).__module__)
        """
    )
    assert out.startswith("ok")


# --- presets: the papers' sizes -------------------------------------------------------------------------


def parameter_counts(model) -> tuple[int, int]:
    """(total, active per token): of the routed experts only num_experts_per_tok of num_experts count as active."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    config = model.config
    if not experts:
        return total, total
    return total, total - experts + experts * config.num_experts_per_tok // config.num_experts


def test_dense_preset_has_the_papers_size():
    with torch.device("meta"):
        gated = GatedAttentionForCausalLM(GatedAttentionConfig.from_preset("dense-1.7b"))
        baseline = GatedAttentionForCausalLM(GatedAttentionConfig.from_preset("dense-1.7b-baseline"))
    total, _ = parameter_counts(gated)
    base_total, _ = parameter_counts(baseline)
    # Qwen3-1.7B's shape is 1.72B with tied embeddings; the paper calls it 1.7B: within 3%.
    assert base_total == pytest.approx(1.7e9, rel=0.03)
    # The gated model pays for its gate with a narrower FFN (as the paper does): equal size within 0.2%, as the
    # width is rounded to a multiple of 32 (672 narrower instead of 683).
    assert total == pytest.approx(base_total, rel=2e-3)
    assert gated.model.layers[0].self_attn.attn_gate.weight.shape == (2048, 2048)


def test_compared_gate_presets_add_their_few_parameters_to_the_baseline():
    with torch.device("meta"):
        baseline = parameter_counts(GatedAttentionForCausalLM(GatedAttentionConfig.from_preset("dense-1.7b-baseline")))[0]
        extra = {name: parameter_counts(GatedAttentionForCausalLM(GatedAttentionConfig.from_preset(name)))[0] - baseline
                 for name in ("dense-1.7b-low-rank", "dense-1.7b-truncated", "dense-1.7b-sinks")}
    # 28 layers: rank 128 between 2048 inputs and 2048 scores; 128 inputs to 2048 scores; one sink per head (16).
    assert extra == {"dense-1.7b-low-rank": 28 * 2 * 128 * 2048, "dense-1.7b-truncated": 28 * 128 * 2048,
                     "dense-1.7b-sinks": 28 * 16}


def test_moe_preset_has_the_papers_size():
    config = GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b")
    with torch.device("meta"):
        gated = GatedAttentionMoeForCausalLM(config)
        baseline = GatedAttentionMoeForCausalLM(GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b", attn_gate=None))
        headwise = GatedAttentionMoeForCausalLM(
            GatedAttentionMoeConfig.from_preset("moe-15b-a2.5b", attn_gate={"granularity": "headwise"})
        )
    total, active = parameter_counts(baseline)
    # The Gated Attention paper: "15B total, 2.54B activated". The Qwen3 shapes give 15.6B (within 5%) and 2.0B active; 2.54B is
    # out of reach for any Qwen3 shape with 15B total (see presets.py), so active is checked within 25%.
    assert total == pytest.approx(15e9, rel=0.05)
    assert active == pytest.approx(2.54e9, rel=0.25)
    # The Gated Attention paper: headwise gating adds "fewer than 2M" parameters to this model; elementwise G1 adds q_proj's size.
    assert 0 < parameter_counts(headwise)[0] - total < 2e6
    assert parameter_counts(gated)[0] - total == 24 * 2048 * 32 * 128
    assert sum(layer.mlp.experts.gate_up_proj.shape[0] == 128 for layer in gated.model.layers) == 24
    assert config.num_experts_per_tok == 8 and config.router_z_loss_coef > 0
