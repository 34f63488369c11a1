"""Test-only reference: a seeded tiny HF model and a plain TP1 copy of its weights into Megatron names.

This is deliberately NOT the project's layout tables (mtrain/layouts): it is the simplest independent
statement of the HF <-> Megatron correspondence at TP1/PP1/EP1, used to check that the *config mapping*
in mtrain.models reproduces transformers' own forward pass. Parallel layouts are then checked against the
TP1 model through Megatron's own dist-checkpoint resharding, not through this file.
"""
from __future__ import annotations

import torch

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def make_hf_model(hf_config: dict, seed: int = 0):
    """transformers' own model for the config, float32, eager attention, with every weight random
    (norm weights and biases too, so a swapped or dropped mapping cannot hide behind ones/zeros)."""
    import transformers

    cfg_name, model_name = HF_CLASSES[hf_config["model_type"]]
    cfg = getattr(transformers, cfg_name)(**hf_config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Megatron's fused QKV rows: per query group g, [q heads of g, k_g, v_g]."""
    d = q.shape[0] // heads
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups, d, *rest)
    k = k.reshape(groups, 1, d, *rest)
    v = v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def hf_to_megatron_tp1(hf_model, hf_config: dict, megatron_state: dict) -> dict:
    """Megatron state dict (TP1/PP1/EP1, local spec names) holding the HF model's weights.

    ``megatron_state`` is the target model's own state_dict (for names and padded shapes); entries
    with no HF counterpart (MTP layers, which transformers does not load) keep their values.
    """
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    cfg = hf_model.config
    out = dict(megatron_state)
    heads = cfg.num_attention_heads
    groups = getattr(cfg, "num_key_value_heads", heads) or heads

    def put(name: str, value: torch.Tensor) -> None:
        if name not in out:
            raise KeyError(f"Megatron model has no parameter {name}")
        if tuple(out[name].shape) != tuple(value.shape):
            raise ValueError(f"{name}: Megatron {tuple(out[name].shape)} vs HF-derived {tuple(value.shape)}")
        out[name] = value

    vocab_rows = megatron_state["embedding.word_embeddings.weight"].shape[0]
    put("embedding.word_embeddings.weight", _pad_rows(sd["model.embed_tokens.weight"], vocab_rows))
    if "output_layer.weight" in out:
        put("output_layer.weight", _pad_rows(sd["lm_head.weight"], vocab_rows))
    put("decoder.final_layernorm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        put(m + "input_layernorm.weight", sd[h + "input_layernorm.weight"])
        put(m + "pre_mlp_layernorm.weight", sd[h + "post_attention_layernorm.weight"])
        a, ma = h + "self_attn.", m + "self_attention."
        put(ma + "linear_proj.weight", sd[a + "o_proj.weight"])
        if hf_config["model_type"] == "deepseek_v3":
            if cfg.q_lora_rank:
                put(ma + "linear_q_down_proj.weight", sd[a + "q_a_proj.weight"])
                put(ma + "q_layernorm.weight", sd[a + "q_a_layernorm.weight"])
                put(ma + "linear_q_up_proj.weight", sd[a + "q_b_proj.weight"])
            else:
                put(ma + "linear_q_proj.weight", sd[a + "q_proj.weight"])
            put(ma + "linear_kv_down_proj.weight", sd[a + "kv_a_proj_with_mqa.weight"])
            put(ma + "kv_layernorm.weight", sd[a + "kv_a_layernorm.weight"])
            put(ma + "linear_kv_up_proj.weight", sd[a + "kv_b_proj.weight"])
        else:
            put(ma + "linear_qkv.weight", _qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], heads, groups))
            if a + "q_proj.bias" in sd:
                put(ma + "linear_qkv.bias", _qkv(sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"], heads, groups))
            if a + "q_norm.weight" in sd:
                put(ma + "q_layernorm.weight", sd[a + "q_norm.weight"])
                put(ma + "k_layernorm.weight", sd[a + "k_norm.weight"])
        p, mp = h + "mlp.", m + "mlp."
        if p + "gate_proj.weight" in sd:  # dense layer
            put(mp + "linear_fc1.weight", torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]))
            put(mp + "linear_fc2.weight", sd[p + "down_proj.weight"])
            continue
        put(mp + "router.weight", sd[p + "gate.weight"])
        if p + "gate.e_score_correction_bias" in sd:
            put(mp + "router.expert_bias", sd[p + "gate.e_score_correction_bias"])
        gate_up, down = sd[p + "experts.gate_up_proj"], sd[p + "experts.down_proj"]  # [E, 2I, H], [E, H, I]
        for e in range(gate_up.shape[0]):
            put(mp + f"experts.local_experts.{e}.linear_fc1.weight", gate_up[e])
            put(mp + f"experts.local_experts.{e}.linear_fc2.weight", down[e])
        if p + "shared_experts.gate_proj.weight" in sd:
            s = p + "shared_experts."
            put(mp + "shared_experts.linear_fc1.weight", torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]]))
            put(mp + "shared_experts.linear_fc2.weight", sd[s + "down_proj.weight"])
    return out
