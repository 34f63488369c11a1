"""Megatron models built by mtrain.models reproduce transformers' own forward pass (TP1, float32).

All cases run in one spawned gloo rank (one Megatron import, one parallel_state) and report the max
|logit difference| against the HF class for the same weights. A negative control shows the comparison
detects a single wrong config field. The yarn cases of the GQA models run 200 tokens, past their
original_max_position_embeddings of 64, where the interpolated frequencies turn further than training saw.
"""
from __future__ import annotations

import pytest
import torch

from mtrain.dist import run_on_ranks

TOL = 1e-4
# Qwen's long-context recipe (rope_scaling yarn, factor 4), scaled down: 64 original positions, 256 in all.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

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
    "mistral_no_window": ("mistral", {}),
    "mistral_window_past_context": ("mistral", {"sliding_window": 256}),
    "qwen2_qkv_bias": ("qwen2", {}),
    "qwen2_yarn": ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_yarn": ("qwen3", {"rope_scaling": YARN}),
    "qwen3_yarn_rope_parameters": ("qwen3", {"rope_parameters": dict(YARN, rope_theta=1e6)}),
    "qwen3_yarn_untruncated_mscales": ("qwen3", {"rope_scaling": dict(YARN, truncate=False, mscale=1.0,
                                                                      mscale_all_dim=0.5, beta_fast=16)}),
    "llama_yarn": ("llama", {"rope_scaling": YARN}),
    "mistral_yarn": ("mistral", {"rope_scaling": YARN}),
    "qwen3_moe_norm_topk": ("qwen3_moe", {}),
    "qwen3_moe_yarn": ("qwen3_moe", {"rope_scaling": YARN}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {"norm_topk_prob": False}),
    "deepseek_v3_yarn": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3_plain_rope": ("deepseek_v3", {"rope_scaling": None}),
}
# Published checkpoints' config.json (tests/models/hf_real_configs.py), shrunk with every structural field kept, as
# shipped and as transformers 5 writes them back. "@64": the yarn block's original length (and the context) scaled
# down so that the 200 tokens run past it; Qwen2.5's card keeps max_position_embeddings = original, Qwen3's 40960.
REAL_CASES = ["Llama-3.2-1B-Instruct", "Llama-3.2-3B-Instruct", "Llama-3.1-8B-Instruct", "TinyLlama-1.1B-Chat-v1.0",
              "SmolLM2-135M", "SmolLM2-1.7B-Instruct", "Qwen2.5-0.5B-Instruct", "Qwen2.5-Math-1.5B-Instruct",
              "DeepSeek-R1-Distill-Qwen-1.5B", "Qwen3-0.6B", "Qwen3-4B-Instruct-2507", "Qwen3-30B-A3B",
              "Mistral-7B-Instruct-v0.3", "Mistral-Nemo-Base-2407", "Ministral-8B-Instruct-2410",
              "Qwen2.5-7B-Instruct+yarn", "Qwen2.5-7B-Instruct+yarn@64", "Qwen3-8B+yarn@64", "Qwen3-30B-A3B+yarn@64"]
CASES.update({f"real {n}": (n, "real") for n in REAL_CASES})
CASES.update({f"real {n} (transformers 5)": (n, "transformers5") for n in
              ("Llama-3.2-1B-Instruct", "Qwen2.5-7B-Instruct+yarn@64", "Qwen3-30B-A3B")})
# Same weights, one Megatron field deliberately wrong: the comparison must see it.
NEGATIVE = {
    "llama_wrong_eps": ("llama", {}, {"layernorm_epsilon": 1e-3}),
    "deepseek_v3_wrong_softmax_scale": ("deepseek_v3", {}, {"mscale_all_dim": 0.0}),
    "qwen3_yarn_wrong_factor": ("qwen3", {"rope_scaling": YARN}, {"yarn_rotary_scaling_factor": 2.0}),
    "qwen3_yarn_unscaled_cos_sin": ("qwen3", {"rope_scaling": YARN}, {"yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0}),
}


def _compare_all(rank: int, world: int, cases: dict, negative: dict) -> dict:
    from hf_real_configs import shrink, transformers5_form
    from hf_reference import hf_to_megatron_tp1, make_hf_model

    from mtrain.dist import init_distributed
    from mtrain.models import build_model, forward_logits
    from mtrain.tiny_configs import numerics_config as tiny_config

    init_distributed()
    short = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(3))
    long = torch.randint(0, 250, (2, 200), generator=torch.Generator().manual_seed(4))
    results = {}
    for name, (arch, changes, *override) in {**cases, **negative}.items():
        if changes in ("real", "transformers5"):
            published, _, original = arch.partition("@")
            hf_config = shrink(published, int(original) if original else None)
            hf_config = transformers5_form(hf_config) if changes == "transformers5" else hf_config
        else:
            hf_config = tiny_config(arch, **changes)
            if "rope_parameters" in changes:  # transformers 5's form: rope_theta inside it
                del hf_config["rope_theta"]
        scaled = "yarn" in name or hf_config.get("rope_scaling") or hf_config.get("rope_parameters", {}).get(
            "rope_type", "default") != "default"
        tokens = long if scaled and hf_config["model_type"] != "deepseek_v3" else short
        chunks, _ = build_model(hf_config, config_overrides=override[0] if override else None)
        hf = make_hf_model(hf_config)
        chunks[0].load_state_dict(hf_to_megatron_tp1(hf, hf_config, chunks[0].state_dict()))
        logits = forward_logits(chunks, tokens)
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        assert logits.shape == ref.shape == (*tokens.shape, hf_config["vocab_size"]), (logits.shape, ref.shape)
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
