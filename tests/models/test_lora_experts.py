"""LoRA on routed experts (Qwen3-MoE, EP2 over 2 gloo ranks): the adapted model equals the base model with every
expert matrix merged (W + (alpha/r) B A), and the adapter gradients follow from the merged model's weight gradient
G by the chain rule: dB = s G A^T, dA = s B^T G (float32, <= 1e-5).

transformers 5 keeps Qwen3-MoE experts fused in memory, which PEFT adapts through target_parameters (one adapter
per fused tensor, not per expert linear), so PEFT is no reference for per-expert adapters: the reference here is
the merged base model, itself checked against transformers by tests/models/test_parallel_forward.py.
"""
from __future__ import annotations

import pytest
import torch

from mtrain.dist import run_on_ranks

TOL = 1e-5
RANK, ALPHA = 4, 8.0


def _run(rank, world, layout):
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from hf_reference import make_hf_model
    from test_lora_numerics import _megatron_grads

    from mtrain.dist import init_distributed
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout, with_adapters
    from mtrain.models import build_model, forward_logits
    from mtrain.models.lora import attach_lora
    from mtrain.reshard.megatron_side import current_layout, load_hf_into_megatron, unwrap
    from mtrain.rollout.reference_engine import hf_disk_views
    from mtrain.tiny_configs import numerics_config

    init_distributed(**layout)
    cfg = numerics_config("qwen3_moe")
    spec = LoraSpec(RANK, ALPHA, ("experts",))
    disk = {k: v.detach().clone() for k, v in hf_disk_views(make_hf_model(cfg)).items()}
    base = model_layout(cfg, mtp=False)
    table = lora_layout(base, spec)
    gen = torch.Generator().manual_seed(9)
    adapters = {w.hf[0].name: 0.1 * torch.randn(w.shape, generator=gen) for w in table.weights}
    merged = dict(disk)
    for name, a in adapters.items():
        if ".lora_A." in name:
            b = adapters[name.replace(".lora_A.", ".lora_B.")]
            w = name.replace(".lora_A.weight", ".weight")
            merged[w] = disk[w] + spec.scaling * b @ a
    tokens = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    r = 0.01 * torch.randn(2, 9, cfg["vocab_size"], generator=torch.Generator().manual_seed(5))

    lora_chunks, _ = build_model(cfg)
    attach_lora(lora_chunks, cfg, spec)
    load_hf_into_megatron(with_adapters(base, spec), lora_chunks, {**disk, **adapters}.__getitem__, rank)
    ref_chunks, _ = build_model(cfg)
    load_hf_into_megatron(base, ref_chunks, merged.__getitem__, rank)
    out = {}
    la, lb = forward_logits(lora_chunks, tokens), forward_logits(ref_chunks, tokens)
    if la is not None:
        out["logits"] = float((la - lb).abs().max())
        out["logit_scale"] = float(lb.abs().max())
    _megatron_grads(lora_chunks, tokens, r)
    _megatron_grads(ref_chunks, tokens, r)
    lp = [dict(unwrap(c).named_parameters()) for c in lora_chunks]
    rp = [dict(unwrap(c).named_parameters()) for c in ref_chunks]
    worst, n, scale = 0.0, 0, 0.0
    by_key = base.by_key()
    for w in table.weights:
        if not w.key.endswith(".A"):
            continue
        b_row = table.by_key()[w.key[:-2] + ".B"]
        base_w = by_key[w.key.split(".lora")[0]]
        hf_part = next(p for p in base_w.hf if p.name.replace(".weight", ".lora_A.weight") == w.hf[0].name)
        for h_a, h_b, h_w in zip(*(current_layout().holders(t, x) for t, x in ((table, w), (table, b_row),
                                                                            (base, base_w)))):
            if h_a.rank != rank:
                continue
            assert h_w.rule_world == 1  # expert-TP 1: each local expert's matrices are whole
            g = rp[h_w.chunk][h_w.name].grad[hf_part.rows[0]:hf_part.rows[1]]
            a, b = adapters[w.hf[0].name], adapters[b_row.hf[0].name]
            want_a, want_b = spec.scaling * b.t() @ g, spec.scaling * g @ a.t()
            got_a, got_b = lp[h_a.chunk][h_a.name].grad, lp[h_b.chunk][h_b.name].grad
            worst = max(worst, float((got_a - want_a).abs().max()), float((got_b - want_b).abs().max()))
            scale = max(scale, float(want_b.abs().max()))
            n += 1
    out.update(grad=worst, n=n, grad_scale=scale)
    return out


@pytest.mark.parametrize("layout", [pytest.param({}, marks=pytest.mark.slow, id="ep1"), pytest.param({"ep": 2}, id="ep2")])
def test_expert_lora_equals_merged_experts(layout):
    world = 2 if layout else 1
    res = run_on_ranks(_run, world, layout, timeout=600)
    assert any("logits" in r for r in res)
    for r in res:
        if "logits" in r:
            assert r["logits"] <= TOL, r
        assert r["n"] > 0 and r["grad_scale"] > 1e-3 and r["grad"] <= TOL, r
