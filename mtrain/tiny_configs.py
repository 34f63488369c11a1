"""Tiny HF config.json dicts for every supported architecture: tests, CPU examples and docs use them.

Two families. `TINY` / `tiny_config` (layouts, trainer, converters, examples): sizes are chosen to exercise awkward layouts: an odd vocabulary (padding on both sides), fewer KV heads
than a TP-4 engine (SGLang replicates KV heads), biases, tied embeddings, MoE with and without shared
experts, MLA with and without q-LoRA, and an MTP layer. `NUMERICS_CONFIGS` / `numerics_config` (the Megatron
model tests against transformers): values differ between architectures (eps, theta, head_dim != hidden/heads,
dense layers mixed into Qwen3-MoE, yarn) so that a config mapping that ignores one shows up.
`TINY["qwen2_5_vl"]` is a layout/numerics fixture (awkward vision sizes); the runnable tiny Qwen2.5-VL with its
tokenizer and image processor is mtrain.tiny_vlm (`mtrain init-tiny --arch qwen2_5_vl`).
"""
from __future__ import annotations

import copy

_COMMON = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
               head_dim=16, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
               rope_theta=10000.0, hidden_act="silu", initializer_range=0.05, torch_dtype="float32",
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY = {
    "llama": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                  attention_bias=False, mlp_bias=False),
    "mistral": dict(_COMMON, model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    sliding_window=None),
    "qwen2": dict(_COMMON, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False,
                  use_sliding_window=False),
    "qwen3": dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
                  attention_bias=False),
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      tie_word_embeddings=False, attention_bias=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                      output_router_logits=False, router_aux_loss_coef=0.0),
    "deepseek_v3": dict(_COMMON, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        tie_word_embeddings=False, num_key_value_heads=4, num_attention_heads=4, head_dim=8,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=32,
                        first_k_dense_replace=1, moe_layer_freq=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                        topk_method="noaux_tc", num_nextn_predict_layers=1, rope_interleave=True,
                        attention_bias=False,
                        rope_scaling=dict(type="yarn", rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}
# Qwen2.5-VL in the release's flat config form (text fields at the top, `vision_config`, mrope in rope_scaling).
# Vision sizes for layouts: 4 vision heads (engine TP 4 splits them), an intermediate size of 44 that SGLang pads
# to 48 (its vision MLP rounds up to a multiple of 8), merger 32*4=128 wide; image token ids inside the vocabulary.
TINY["qwen2_5_vl"] = dict(
    _COMMON, model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], tie_word_embeddings=False,
    num_attention_heads=4, head_dim=16, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]),
    image_token_id=97, video_token_id=98, vision_start_token_id=99, vision_end_token_id=100,
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=44, num_heads=4, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                       in_channels=3, hidden_act="silu", tokens_per_second=2, initializer_range=0.05))
TINY["qwen2_5_vl_tied"] = dict(TINY["qwen2_5_vl"], tie_word_embeddings=True)
# Qwen3 with Qwen's long-context rope_scaling (yarn), scaled down: 16 original positions, 256 in all, so the trainer
# tests' samples (up to 34 tokens) run past the original length.
TINY["qwen3_yarn"] = dict(TINY["qwen3"], rope_scaling=dict(rope_type="yarn", factor=16.0,
                                                           original_max_position_embeddings=16))
# DeepSeek-style MLA without q-LoRA (DeepSeek-V2-Lite's attention) on the V3 code path.
TINY["deepseek_v3_no_qlora"] = dict(TINY["deepseek_v3"], q_lora_rank=None)

# The scaled-down DeepSeek-V3 of examples/deepseek_v3/small: the 671B release's config.json with only sizes
# changed (tests/test_tiny_configs.py checks that against examples/deepseek_v3/full/config.json). 7 layers =
# 3 dense (first_k_dense_replace, as the release) + 4 MoE: on PP2 they split unevenly 3 | 4 like the release's
# 61 on PP16 (3 | 4 x 14 | 2); 16 routed experts on EP2 leave 8 per rank, as 256 on EP32 do; one MTP layer;
# FP8 blocks 128x128 (most matrices here are one partial block). Per-head sizes are small for the CPU; the GPU
# variant (deepseek_v3_small_gpu) keeps the release's per-head and LoRA sizes, which SGLang's MLA kernels need.
_DSV3_RELEASE = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False, attention_dropout=0.0,
    aux_loss_alpha=0.001, hidden_act="silu", initializer_range=0.02, moe_layer_freq=1, n_shared_experts=1,
    norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid",
    seq_aux=True, tie_word_embeddings=False, topk_method="noaux_tc", num_nextn_predict_layers=1,
    first_k_dense_replace=3, torch_dtype="bfloat16", use_cache=True, bos_token_id=0, eos_token_id=1,
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=[128, 128]))
TINY["deepseek_v3_small"] = dict(
    _DSV3_RELEASE, vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_group=4, topk_group=2,
    num_experts_per_tok=4, max_position_embeddings=1024,
    rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0))
TINY["deepseek_v3_small_gpu"] = dict(
    TINY["deepseek_v3_small"], vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=4096,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0))


def tiny_config(name: str, **overrides) -> dict:
    cfg = copy.deepcopy(TINY[name])
    cfg.update(copy.deepcopy(overrides))  # transformers' config classes fill nested dicts (rope_scaling) in place
    return cfg

# ---------------------------------------------------------------- numerics family (model tests)

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

NUMERICS_CONFIGS: dict[str, dict] = {
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
    "mistral": dict(
        _BASE,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        head_dim=32,  # head_dim * heads != hidden, as in Mistral-Nemo
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        sliding_window=None,  # Mistral 7B v0.2 on: no window (v0.1's 4096 is refused)
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


def numerics_config(model_type: str, **changes) -> dict:
    """A deep copy of the numerics config for ``model_type`` with ``changes`` applied."""
    if model_type not in NUMERICS_CONFIGS:
        raise KeyError(f"no numerics config for model_type={model_type!r}; have {sorted(NUMERICS_CONFIGS)}")
    cfg = copy.deepcopy(NUMERICS_CONFIGS[model_type])
    cfg.update(copy.deepcopy(changes))  # transformers' config classes fill nested dicts (rope_scaling) in place
    return cfg
