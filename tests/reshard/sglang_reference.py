"""An independent reference: SGLang's per-rank parameters, sliced from full HF tensors the way SGLang's own
weight loaders do it (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding, FusedMoE, DeepSeek's fused_qkv_a_proj_with_mqa). Written from SGLang 0.5.17's
weight_loader code paths (docs/sglang-layout.md), deliberately without the layout tables or the planner.
"""
from __future__ import annotations

import torch


def _chunk(t: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // world
    assert n * world == t.shape[dim]
    return t.narrow(dim, rank * n, n)


def _vocab(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    padded = -(-t.shape[0] // 64) * 64
    full = torch.zeros((padded, t.shape[1]), dtype=t.dtype)
    full[: t.shape[0]] = t
    return _chunk(full, rank, world)


def _qkv(q, k, v, heads, kv_heads, rank, tp):
    d = q.shape[0] // heads
    q_r = _chunk(q, rank, tp)
    if kv_heads >= tp:
        k_r, v_r = _chunk(k, rank, tp), _chunk(v, rank, tp)
    else:  # replicated KV heads: shard id = rank // replicas
        h = rank // (tp // kv_heads)
        k_r, v_r = k[h * d:(h + 1) * d], v[h * d:(h + 1) * d]
    return torch.cat([q_r, k_r, v_r])


def sglang_rank_params(hf: dict[str, torch.Tensor], cfg: dict, rank: int, tp: int, ep: int = 1) -> dict:
    out = {}
    arch = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or heads
    moe_tp, ep_rank = tp // ep, rank // (tp // ep)
    moe_tp_rank = rank % (tp // ep)
    out["model.embed_tokens.weight"] = _vocab(hf["model.embed_tokens.weight"], rank, tp)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = _vocab(hf["lm_head.weight"], rank, tp)
    elif arch == "qwen3_moe":  # SGLang's Qwen3-MoE never ties its head (models/qwen3_moe.py)
        out["lm_head.weight"] = _vocab(hf["model.embed_tokens.weight"], rank, tp)
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
        if arch == "deepseek_v3":
            if cfg.get("q_lora_rank"):
                out[a + "fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
                    [hf[a + "q_a_proj.weight"], hf[a + "kv_a_proj_with_mqa.weight"]])
                out[a + "q_a_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
                out[a + "q_b_proj.weight"] = _chunk(hf[a + "q_b_proj.weight"], rank, tp)
            else:
                out[a + "q_proj.weight"] = _chunk(hf[a + "q_proj.weight"], rank, tp)
                out[a + "kv_a_proj_with_mqa.weight"] = hf[a + "kv_a_proj_with_mqa.weight"]
            out[a + "kv_a_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
            out[a + "kv_b_proj.weight"] = _chunk(hf[a + "kv_b_proj.weight"], rank, tp)
        else:
            out[a + "qkv_proj.weight"] = _qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                                              hf[a + "v_proj.weight"], heads, kvh, rank, tp)
            if a + "q_proj.bias" in hf:
                out[a + "qkv_proj.bias"] = _qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                                hf[a + "v_proj.bias"], heads, kvh, rank, tp)
            for n in ("q_norm.weight", "k_norm.weight"):
                if a + n in hf:
                    out[a + n] = hf[a + n]
        out[a + "o_proj.weight"] = _chunk(hf[a + "o_proj.weight"], rank, tp, dim=1)
        m = p + "mlp."
        if m + "gate.weight" in hf:
            out[m + "gate.weight"] = hf[m + "gate.weight"]
            if m + "gate.e_score_correction_bias" in hf:
                out[m + "gate.e_score_correction_bias"] = hf[m + "gate.e_score_correction_bias"]
            n_exp = cfg.get("num_experts") or cfg["n_routed_experts"]
            local = n_exp // ep
            w13, w2 = [], []
            for j in range(local):
                e = m + f"experts.{ep_rank * local + j}."
                w13.append(torch.cat([_chunk(hf[e + "gate_proj.weight"], moe_tp_rank, moe_tp),
                                      _chunk(hf[e + "up_proj.weight"], moe_tp_rank, moe_tp)]))
                w2.append(_chunk(hf[e + "down_proj.weight"], moe_tp_rank, moe_tp, dim=1))
            out[m + "experts.w13_weight"] = torch.stack(w13)
            out[m + "experts.w2_weight"] = torch.stack(w2)
            if m + "shared_experts.gate_proj.weight" in hf:
                s = m + "shared_experts."
                out[s + "gate_up_proj.weight"] = torch.cat([_chunk(hf[s + "gate_proj.weight"], rank, tp),
                                                            _chunk(hf[s + "up_proj.weight"], rank, tp)])
                out[s + "down_proj.weight"] = _chunk(hf[s + "down_proj.weight"], rank, tp, dim=1)
        else:
            out[m + "gate_up_proj.weight"] = torch.cat([_chunk(hf[m + "gate_proj.weight"], rank, tp),
                                                        _chunk(hf[m + "up_proj.weight"], rank, tp)])
            out[m + "down_proj.weight"] = _chunk(hf[m + "down_proj.weight"], rank, tp, dim=1)
    return out


def _pad_rows(t: torch.Tensor, multiple: int, dim: int = 0) -> torch.Tensor:
    """SGLang's pad_or_narrow_weight for Qwen2.5-VL's vision MLP: zeros appended up to a multiple along dim."""
    n = t.shape[dim]
    padded = -(-n // multiple) * multiple
    if padded == n:
        return t
    shape = list(t.shape)
    shape[dim] = padded - n
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def sglang_vision_params(hf: dict[str, torch.Tensor], cfg: dict, rank: int, tp: int) -> dict:
    """Qwen2.5-VL's `visual.*` parameters on SGLang engine rank `rank` of `tp` (models/qwen2_5_vl.py 0.5.17):
    the fused HF `attn.qkv` split into q/k/v and each cut by heads (QKVParallelLinear with as many KV heads as
    heads), `attn.proj`/`mlp.down_proj`/`merger.mlp.2` cut by input features with whole biases (RowParallelLinear),
    gate/up padded to a multiple of 8 rows and cut (MergedColumnParallelLinear), `merger.mlp.0` cut by rows,
    the rest whole."""
    vc = cfg["vision_config"]
    dim = vc["hidden_size"]
    out = {}
    for name, t in hf.items():
        if not name.startswith("visual."):
            continue
        if ".attn.qkv." in name:
            q, k, v = t.split(dim, dim=0)
            out[name.replace("attn.qkv.", "attn.qkv_proj.")] = torch.cat([_chunk(x, rank, tp) for x in (q, k, v)])
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            continue  # fused below
        elif name.endswith(("attn.proj.weight", "mlp.down_proj.weight", "merger.mlp.2.weight")):
            out[name] = _chunk(_pad_rows(t, 8, dim=1) if "down_proj" in name else t, rank, tp, dim=1)
        elif "merger.mlp.0." in name:
            out[name] = _chunk(t, rank, tp)
        else:
            out[name] = t
    for name in [n for n in hf if n.startswith("visual.") and ".mlp.gate_proj." in n]:
        up = name.replace("gate_proj", "up_proj")
        out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
            [_chunk(_pad_rows(hf[name], 8), rank, tp), _chunk(_pad_rows(hf[up], 8), rank, tp)])
    return out
