"""Test-only table: the config.json fields of published checkpoints that users point model.hf_path at, as the Hub
ships them (sizes included; token ids and the transformers_version stamp left out), and `shrink`, which keeps
every structural field of one (model_type, head_dim against hidden/heads, the KV-head ratio, tied embeddings, RoPE
and its scaling, sliding-window fields, MoE fields) at sizes a CPU forward takes in milliseconds."""
from __future__ import annotations

import copy

_LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
              hidden_act="silu", initializer_range=0.02, mlp_bias=False, pretraining_tp=1, rms_norm_eps=1e-5,
              torch_dtype="bfloat16", use_cache=True)
_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_dropout=0.0, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-6, torch_dtype="bfloat16", use_cache=True,
              use_sliding_window=False, vocab_size=151936)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0,
              head_dim=128, hidden_act="silu", initializer_range=0.02, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000, sliding_window=None, torch_dtype="bfloat16",
              use_cache=True, use_sliding_window=False, vocab_size=151936)
_MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", initializer_range=0.02,
                rms_norm_eps=1e-5, torch_dtype="bfloat16", use_cache=True, tie_word_embeddings=False)
# What Qwen's model cards tell users to add to config.json for long contexts (Qwen2.5 writes "type", Qwen3
# "rope_type"); max_position_embeddings stays as shipped.
QWEN2_5_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

REAL = {
    "Llama-3.2-1B-Instruct": dict(_LLAMA, head_dim=64, hidden_size=2048, intermediate_size=8192,
                                  max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=16,
                                  num_key_value_heads=8, rope_scaling=_LLAMA3, rope_theta=500000.0,
                                  tie_word_embeddings=True, vocab_size=128256),
    "Llama-3.2-3B-Instruct": dict(_LLAMA, head_dim=128, hidden_size=3072, intermediate_size=8192,
                                  max_position_embeddings=131072, num_attention_heads=24, num_hidden_layers=28,
                                  num_key_value_heads=8, rope_scaling=_LLAMA3, rope_theta=500000.0,
                                  tie_word_embeddings=True, vocab_size=128256),
    # DeepSeek-R1-Distill-Llama-8B ships the same fields
    "Llama-3.1-8B-Instruct": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
                                  num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
                                  rope_scaling=dict(_LLAMA3, factor=8.0), rope_theta=500000.0,
                                  tie_word_embeddings=False, vocab_size=128256),
    "TinyLlama-1.1B-Chat-v1.0": dict(_LLAMA, hidden_size=2048, intermediate_size=5632, max_position_embeddings=2048,
                                     num_attention_heads=32, num_hidden_layers=22, num_key_value_heads=4,
                                     rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False,
                                     vocab_size=32000),
    "SmolLM2-135M": dict(_LLAMA, hidden_size=576, initializer_range=0.041666666666666664, intermediate_size=1536,
                         is_llama_config=True, max_position_embeddings=8192, num_attention_heads=9,
                         num_hidden_layers=30, num_key_value_heads=3, rope_interleaved=False, rope_scaling=None,
                         rope_theta=100000, tie_word_embeddings=True, vocab_size=49152),
    "SmolLM2-1.7B-Instruct": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, is_llama_config=True,
                                  max_position_embeddings=8192, num_attention_heads=32, num_hidden_layers=24,
                                  num_key_value_heads=32, rope_interleaved=False, rope_scaling=None, rope_theta=130000,
                                  tie_word_embeddings=True, vocab_size=49152),
    "Qwen2.5-0.5B-Instruct": dict(_QWEN2, hidden_size=896, intermediate_size=4864, max_position_embeddings=32768,
                                  max_window_layers=21, num_attention_heads=14, num_hidden_layers=24,
                                  num_key_value_heads=2, rope_theta=1000000.0, sliding_window=32768,
                                  tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, max_position_embeddings=32768,
                                max_window_layers=28, num_attention_heads=28, num_hidden_layers=28,
                                num_key_value_heads=4, rope_theta=1000000.0, sliding_window=131072,
                                tie_word_embeddings=False),
    "Qwen2.5-Math-1.5B-Instruct": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, max_position_embeddings=4096,
                                       max_window_layers=21, num_attention_heads=12, num_hidden_layers=28,
                                       num_key_value_heads=2, rope_theta=10000.0, sliding_window=4096,
                                       tie_word_embeddings=True),
    # -7B: the sizes of Qwen2.5-7B, the same window fields
    "DeepSeek-R1-Distill-Qwen-1.5B": dict(_QWEN2, hidden_size=1536, intermediate_size=8960,
                                          max_position_embeddings=131072, max_window_layers=21, num_attention_heads=12,
                                          num_hidden_layers=28, num_key_value_heads=2, rope_theta=10000,
                                          sliding_window=4096, tie_word_embeddings=False, use_mrope=False),
    "Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
                       num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
                     num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False),
    # -Thinking-2507 ships the same fields
    "Qwen3-4B-Instruct-2507": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, max_position_embeddings=262144,
                                   max_window_layers=36, num_attention_heads=32, num_hidden_layers=36,
                                   num_key_value_heads=8, rope_theta=5000000, tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                          hidden_size=2048, intermediate_size=6144, max_window_layers=48, mlp_only_layers=[],
                          moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
                          output_router_logits=False, rope_theta=1000000.0, router_aux_loss_coef=0.001,
                          tie_word_embeddings=False),
    "Mistral-7B-v0.1": dict(_MISTRAL, hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
                            num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rope_theta=10000.0,
                            sliding_window=4096, vocab_size=32000),
    "Mistral-7B-Instruct-v0.3": dict(_MISTRAL, attention_dropout=0.0, hidden_size=4096, intermediate_size=14336,
                                     max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32,
                                     num_key_value_heads=8, rope_theta=1000000.0, sliding_window=None,
                                     vocab_size=32768),
    "Mistral-Nemo-Base-2407": dict(_MISTRAL, attention_dropout=0.0, head_dim=128, hidden_size=5120,
                                   intermediate_size=14336, max_position_embeddings=1024000, num_attention_heads=32,
                                   num_hidden_layers=40, num_key_value_heads=8, rope_theta=1000000.0,
                                   sliding_window=None, vocab_size=131072),
    "Ministral-8B-Instruct-2410": dict(_MISTRAL, attention_dropout=0.0, head_dim=128, hidden_size=4096,
                                       intermediate_size=12288, max_position_embeddings=32768, num_attention_heads=32,
                                       num_hidden_layers=36, num_key_value_heads=8, rope_theta=100000000.0,
                                       sliding_window=32768, vocab_size=131072),
    "OLMo-2-1124-7B": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", attention_bias=False,
                           hidden_act="silu", hidden_size=4096, intermediate_size=11008, max_position_embeddings=4096,
                           num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32, rms_norm_eps=1e-6,
                           rope_theta=500000, vocab_size=100352),
    "gemma-2b": dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=256, hidden_act="gelu",
                     hidden_size=2048, intermediate_size=16384, max_position_embeddings=8192, num_attention_heads=8,
                     num_hidden_layers=18, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                     vocab_size=256000),
    "gemma-2-2b-it": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                          hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_hidden_layers=26,
                          num_key_value_heads=4, query_pre_attn_scalar=256, sliding_window=4096, vocab_size=256000),
    "gemma-3-1b-it": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=256,
                          hidden_size=1152, intermediate_size=6912, max_position_embeddings=32768,
                          num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
                          rope_local_base_freq=10000, rope_theta=1000000, sliding_window=512, vocab_size=262144),
}
REAL["Qwen2.5-7B-Instruct+yarn"] = dict(REAL["Qwen2.5-7B-Instruct"], rope_scaling=QWEN2_5_YARN)
REAL["Qwen3-8B+yarn"] = dict(REAL["Qwen3-8B"], rope_scaling=QWEN3_YARN)
REAL["Qwen3-30B-A3B+yarn"] = dict(REAL["Qwen3-30B-A3B"], rope_scaling=QWEN3_YARN)
# Qwen2.5-7B/14B-Instruct-1M: Qwen2 with dual-chunk attention
REAL["Qwen2.5-7B-Instruct-1M"] = dict(REAL["Qwen2.5-7B-Instruct"], max_position_embeddings=1010000,
                                      rope_theta=10000000.0, sliding_window=32768, dual_chunk_attention_config=dict(
                                          chunk_size=262144, local_size=8192, original_max_position_embeddings=262144))

# name -> the start of its one-line refusal; every other name maps
REFUSED = {
    "Mistral-7B-v0.1": "mistral sliding_window=4096 is not supported: mtrain's packed attention computes full causal",
    "OLMo-2-1124-7B": "model_type='olmo2' is not supported; supported: llama, mistral, qwen2,",
    "gemma-2b": "model_type='gemma' is not supported",
    "gemma-2-2b-it": "model_type='gemma2' is not supported",
    "gemma-3-1b-it": "model_type='gemma3_text' is not supported",
    "Qwen2.5-7B-Instruct-1M": "qwen2 dual_chunk_attention_config is not supported: SGLang then computes dual-chunk",
}


def shrink(name: str, yarn_original: int | None = None) -> dict:
    """REAL[name] at 2 layers, head_dim 16, hidden and KV heads in the shipped ratios, 250 tokens, 8 experts of 16.
    RoPE fields stay as shipped (Megatron fixes llama3's original length at 8192); `yarn_original` scales a yarn
    block's original_max_position_embeddings and max_position_embeddings down together, so that a short sequence
    runs past the original length."""
    c = copy.deepcopy(REAL[name])
    heads = c["num_attention_heads"]
    ratio = heads // (c.get("num_key_value_heads") or heads)
    kv = 1 if ratio >= 4 else 2
    hidden = ratio * kv * 16
    if c.get("head_dim") and c["head_dim"] * heads != c["hidden_size"]:  # keep hidden != heads * head_dim
        hidden = 2 * round(hidden * c["hidden_size"] / (heads * c["head_dim"]) / 2)
    c.update(num_attention_heads=ratio * kv, num_key_value_heads=kv, hidden_size=hidden, intermediate_size=48,
             num_hidden_layers=2, vocab_size=250)
    if "head_dim" in c:
        c["head_dim"] = 16
    if "num_experts" in c:
        c.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    if "max_window_layers" in c:
        c["max_window_layers"] = 1  # a window, were it on, would cover the second layer
    if yarn_original:
        scaling = c["rope_scaling"]
        c["max_position_embeddings"] = c["max_position_embeddings"] * yarn_original \
            // scaling["original_max_position_embeddings"]
        c["rope_scaling"] = dict(scaling, original_max_position_embeddings=yarn_original)
    return c


def transformers5_form(cfg: dict) -> dict:
    """cfg as transformers 5 writes it back (save_pretrained): rope_theta and rope_scaling inside rope_parameters,
    dtype for torch_dtype, layer_types and the other derived fields filled in."""
    import json

    import transformers
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return json.loads(transformers.AutoConfig.for_model(**copy.deepcopy(cfg)).to_json_string(use_diff=True))
    finally:
        transformers.logging.set_verbosity(level)
