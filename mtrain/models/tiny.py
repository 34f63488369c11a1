"""Tiny HF ``config.json`` dicts for the five architectures (tests, name dumps, CPU demos).

Shapes are small but every feature of the architecture is on: GQA, QKV bias (qwen2), qk-norm (qwen3),
MoE with dense layers mixed in (qwen3_moe ``mlp_only_layers``, deepseek_v3 ``first_k_dense_replace``),
MLA with and without ``q_lora_rank``, shared experts, grouped sigmoid routing, MTP, tied embeddings (llama).
Values differ from each other (eps, theta, head_dim) so a mapping that ignores one shows up in tests.
"""
from __future__ import annotations

import copy

_BASE = dict(
    vocab_size=250,  # not a multiple of 128: exercises vocab padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=256,
    initializer_range=0.02,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        _BASE,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    ),
    "qwen2": dict(
        _BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        _BASE,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        head_dim=32,  # head_dim * heads != hidden, as in real Qwen3
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        router_aux_loss_coef=0.001,
    ),
    "deepseek_v3": dict(
        _BASE,
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        num_nextn_predict_layers=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_scaling=dict(
            type="yarn",
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}


def tiny_config(model_type: str, **changes) -> dict:
    """A deep copy of the tiny config for ``model_type`` with ``changes`` applied."""
    if model_type not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for model_type={model_type!r}; have {sorted(TINY_CONFIGS)}")
    cfg = copy.deepcopy(TINY_CONFIGS[model_type])
    cfg.update(changes)
    return cfg
