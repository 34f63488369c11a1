"""Megatron models built by mtrain.models reproduce transformers' own forward pass (TP1, float32).

All cases run in one spawned gloo rank (one Megatron import, one parallel_state) and report the max
|logit difference| against the HF class for the same weights. A negative control shows the comparison
detects a single wrong config field.
"""
from __future__ import annotations

import pytest
import torch

from mtrain.dist import run_on_ranks

TOL = 1e-4

CASES = {
    "llama_tied": ("llama", {}),
    "llama_rope_llama3": (
        "llama",
        {
            "max_position_embeddings": 16384,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "qwen2_qkv_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_moe_norm_topk": ("qwen3_moe", {}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "deepseek_v3_yarn": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3_plain_rope": ("deepseek_v3", {"rope_scaling": None}),
}
# Same weights, one Megatron field deliberately wrong: the comparison must see it.
NEGATIVE = {
    "llama_wrong_eps": ("llama", {}, {"layernorm_epsilon": 1e-3}),
    "deepseek_v3_wrong_softmax_scale": ("deepseek_v3", {}, {"mscale_all_dim": 0.0}),
}


def _compare_all(rank: int, world: int, cases: dict, negative: dict) -> dict:
    from hf_reference import hf_to_megatron_tp1, make_hf_model

    from mtrain.dist import init_distributed
    from mtrain.models import build_model, forward_logits
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed()
    tokens = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(3))
    results = {}
    for name, (arch, changes, *override) in {**cases, **negative}.items():
        hf_config = tiny_config(arch, **changes)
        chunks, _ = build_model(hf_config, config_overrides=override[0] if override else None)
        hf = make_hf_model(hf_config)
        chunks[0].load_state_dict(hf_to_megatron_tp1(hf, hf_config, chunks[0].state_dict()))
        logits = forward_logits(chunks, tokens)
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        assert logits.shape == ref.shape == (2, 11, hf_config["vocab_size"]), (logits.shape, ref.shape)
        results[name] = float((logits - ref).abs().max())
    return results


@pytest.fixture(scope="module")
def diffs() -> dict:
    # pytest puts this folder on sys.path; spawned ranks inherit it and import hf_reference from here.
    return run_on_ranks(_compare_all, 1, CASES, NEGATIVE, timeout=600)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(diffs, case):
    assert diffs[case] < TOL, f"{case}: max |megatron - transformers| = {diffs[case]:.3e}"


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_comparison_detects_a_wrong_field(diffs, case):
    assert diffs[case] > 100 * TOL, f"{case}: a wrong field went unnoticed ({diffs[case]:.3e})"
