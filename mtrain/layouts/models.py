"""Per-architecture layout tables, assembled from the blocks in `blocks.py`.

`model_layout(hf_config)` is the one entry point: it reads a HF config.json dict and returns every logical
weight of the model with its Megatron, HF and SGLang names and shardings.
"""
from __future__ import annotations

from dataclasses import replace

from mtrain.layouts.blocks import (MegatronNames, dense_mlp_rows, embedding_rows, gqa_rows, megatron_vocab_rule,
                                   mla_rows, moe_rows, norm)
from mtrain.layouts.rules import LayoutError
from mtrain.layouts.table import COL, ModelLayout, Weight, one
from mtrain.layouts.vlm import VLM_ARCHS, flat_config, vision_rows

DECODER = "decoder.layers.{layer}."  # {layer}: index inside the pipeline chunk, resolved by placement
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3") + VLM_ARCHS
QKV_BIAS_ARCHS = ("qwen2", "qwen2_5_vl")  # q/k/v_proj always biased, o_proj never (Qwen2Attention)


def canonical_config(cfg: dict) -> dict:
    """The config keys the tables read. transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`
    (older configs and the release say `num_experts`). Qwen2.5-VL's text fields come to the top level."""
    cfg = flat_config(cfg)
    if cfg.get("model_type") == "qwen3_moe" and "num_experts" not in cfg and "num_local_experts" in cfg:
        return dict(cfg, num_experts=cfg["num_local_experts"])
    return cfg


def _is_moe_layer(cfg: dict, i: int) -> bool:
    arch = cfg["model_type"]
    if arch == "qwen3_moe":
        step = cfg.get("decoder_sparse_step", 1) or 1
        return cfg.get("num_experts", 0) > 0 and i not in cfg.get("mlp_only_layers", []) and (i + 1) % step == 0
    if arch == "deepseek_v3":
        freq = cfg.get("moe_layer_freq", 1) or 1
        return bool(cfg.get("n_routed_experts")) and i >= cfg.get("first_k_dense_replace", 0) and i % freq == 0
    return False


def moe_layer_pattern(cfg: dict) -> list[int]:
    """1 for an MoE layer, 0 for a dense one: what Megatron's moe_layer_freq takes as a list."""
    cfg = canonical_config(cfg)
    return [int(_is_moe_layer(cfg, i)) for i in range(cfg["num_hidden_layers"])]


def _layer_rows(cfg: dict, i: int, mp: str, hp: str, names: MegatronNames, **kw) -> list[Weight]:
    arch = cfg["model_type"]
    if arch == "deepseek_v3":
        rows = mla_rows(cfg, i, mp, hp, names, **kw)
    else:
        bias = arch in QKV_BIAS_ARCHS or bool(cfg.get("attention_bias", False))
        o_bias = arch not in QKV_BIAS_ARCHS and bool(cfg.get("attention_bias", False))
        rows = gqa_rows(cfg, i, mp, hp, names, bias=bias, qk_norm=arch in ("qwen3", "qwen3_moe"), o_bias=o_bias, **kw)
    if _is_moe_layer(cfg, i):
        if arch == "qwen3_moe":
            rows += moe_rows(cfg, i, mp, hp, names, cfg["num_experts"], cfg["moe_intermediate_size"], **kw)
        else:
            shared = cfg.get("n_shared_experts") or 0
            rows += moe_rows(cfg, i, mp, hp, names, cfg["n_routed_experts"], cfg["moe_intermediate_size"],
                             shared_inter=shared * cfg["moe_intermediate_size"], expert_bias=True, **kw)
    else:
        rows += dense_mlp_rows(cfg, i, mp, hp, names, cfg["intermediate_size"], **kw)
    return rows


def _mtp_rows(cfg: dict, k: int, names: MegatronNames, divisible_by: int) -> list[Weight]:
    """DeepSeek-V3 multi-token-prediction depth k: HF stores it as decoder layer num_hidden_layers + k.

    SGLang's main model skips these weights (its NextN draft model loads them), so they have no SGLang side.
    """
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    i = cfg["num_hidden_layers"] + k
    mp, hp = f"mtp.layers.{k}.", f"model.layers.{i}."
    kw = dict(region="mtp", layer=k)
    vocab_rule = megatron_vocab_rule(divisible_by)
    # megatron-core 0.19 names the MTP depth's inner layer `mtp_model_layer` (0.16: `transformer_layer`).
    rows = _layer_rows(cfg, i, mp + "mtp_model_layer.", hp, names, **kw)
    rows = [replace(w, sglang=()) for w in rows]
    rows += [
        norm(f"L{i}.enorm", hidden, f"{mp}enorm.weight", f"{hp}enorm.weight", None, **kw),
        norm(f"L{i}.hnorm", hidden, f"{mp}hnorm.weight", f"{hp}hnorm.weight", None, **kw),
        Weight(f"L{i}.eh_proj", (hidden, 2 * hidden), one(f"{mp}eh_proj.weight", hidden, COL),
               one(f"{hp}eh_proj.weight", hidden), (), **kw),
        norm(f"L{i}.head_norm", hidden, f"{mp}final_layernorm.weight", f"{hp}shared_head.norm.weight", None, **kw),
        # HF repeats the embedding and head in the MTP layer; Megatron shares the main model's. Read them from
        # the main model's tensors; write them only where the destination really has a separate tensor.
        Weight(f"L{i}.embed_copy", (vocab, hidden), one("embedding.word_embeddings.weight", vocab, vocab_rule, write=False),
               one(f"{hp}embed_tokens.weight", vocab), (), region="embed"),
        Weight(f"L{i}.head_copy", (vocab, hidden),
               one("output_layer.weight" if not cfg.get("tie_word_embeddings") else
                   "embedding.word_embeddings.weight", vocab, vocab_rule, write=False),
               one(f"{hp}shared_head.head.weight", vocab), (),
               region="final" if not cfg.get("tie_word_embeddings") else "embed"),
    ]
    return rows


def model_layout(cfg: dict, *, te: bool = False, make_vocab_size_divisible_by: int = 128,
                 mtp: bool = True) -> ModelLayout:
    """Every logical weight of the model described by a HF config.json dict."""
    cfg = canonical_config(cfg)
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise LayoutError(f"unsupported model_type {arch!r}; supported: {', '.join(ARCHS)}")
    names = MegatronNames(te=te)
    if make_vocab_size_divisible_by <= 0:
        raise LayoutError("make_vocab_size_divisible_by must be positive")
    weights = embedding_rows(cfg, make_vocab_size_divisible_by)
    for i in range(cfg["num_hidden_layers"]):
        weights += _layer_rows(cfg, i, DECODER, f"model.layers.{i}.", names, layer=i)
    mtp_layers = (cfg.get("num_nextn_predict_layers") or 0) if (mtp and arch == "deepseek_v3") else 0
    for k in range(mtp_layers):
        weights += _mtp_rows(cfg, k, names, make_vocab_size_divisible_by)
    if arch in VLM_ARCHS:
        weights += vision_rows(cfg)
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    meta = {"te": te, "divisible_by": make_vocab_size_divisible_by, "vision": arch in VLM_ARCHS}
    if arch == "qwen3_moe" and not all(moe_layer_pattern(cfg)):
        # SGLang 0.5.17 builds every Qwen3-MoE layer sparse, ignoring mlp_only_layers/decoder_sparse_step.
        meta["sglang_unsupported"] = (f"SGLang 0.5.17 makes every Qwen3-MoE layer sparse; this config has dense layers "
                                      f"(mlp_only_layers={cfg.get('mlp_only_layers')}, decoder_sparse_step="
                                      f"{cfg.get('decoder_sparse_step', 1)})")

    return ModelLayout(arch=arch, weights=weights, num_layers=cfg["num_hidden_layers"], num_experts=experts,
                       mtp_layers=mtp_layers, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       vocab_size=cfg["vocab_size"], meta=meta)
