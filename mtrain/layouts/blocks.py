"""Table rows for the building blocks shared by every architecture: embeddings, attention, MLP, MoE, MLA.

Each function returns the `Weight` rows of one block for one layer. Megatron names follow the local
layer spec; with Transformer Engine (`te=True`) the names that TE fuses differ, and `MegatronNames` holds
that difference in one place. SGLang facts are cited in docs/sglang-layout.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtrain.layouts.rules import Block, Fused, GroupedQKV, Replicated, VocabSplit
from mtrain.layouts.table import COL, ROW, Part, Weight, one, stacked

SGLANG_VOCAB = VocabSplit(64, per_rank_multiple=False)


def megatron_vocab_rule(divisible_by: int) -> VocabSplit:
    return VocabSplit(divisible_by, per_rank_multiple=True)


def gated(inter: int, what: str) -> Fused:
    """[gate_r; up_r] on every rank: Megatron's fc1 and SGLang's gate_up_proj / w13 alike."""
    return Fused((Block(inter, 1, f"{what} (gate)"), Block(inter, 1, f"{what} (up)")))


@dataclass(frozen=True)
class MegatronNames:
    """Megatron parameter names that depend on the layer spec (local vs Transformer Engine)."""

    te: bool = False

    def input_norm(self, p: str, mla: bool) -> str:
        return f"{p}self_attention.linear_qkv.layer_norm_weight" if self.te and not mla else f"{p}input_layernorm.weight"

    def pre_mlp_norm(self, p: str, moe: bool) -> str:
        return f"{p}mlp.linear_fc1.layer_norm_weight" if self.te and not moe else f"{p}pre_mlp_layernorm.weight"

    def mla_q_norm(self, p: str) -> str:
        return f"{p}self_attention.linear_q_up_proj.layer_norm_weight" if self.te else f"{p}self_attention.q_layernorm.weight"

    def mla_kv_norm(self, p: str) -> str:
        return f"{p}self_attention.linear_kv_up_proj.layer_norm_weight" if self.te else f"{p}self_attention.kv_layernorm.weight"

    def expert(self, p: str, fc: str) -> str:
        if self.te:
            return f"{p}mlp.experts.{fc}.weight{{expert}}"
        return f"{p}mlp.experts.local_experts.{{expert}}.{fc}.weight"

    def mla_down_rule(self):
        # Local spec builds the down projections as ColumnParallelLinear (output split over TP, gathered in
        # forward); TE builds them as a duplicated TELinear (every TP rank holds the whole matrix).
        return Replicated() if self.te else COL


def norm(key: str, n: int, mg: str | None, hf: str, sg: str | None, **kw) -> Weight:
    return Weight(key, (n,), one(mg, n) if mg else (), one(hf, n), one(sg, n) if sg else (), **kw)


def embedding_rows(cfg: dict, divisible_by: int) -> list[Weight]:
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    mg_vocab = megatron_vocab_rule(divisible_by)
    rows = [
        Weight("embed", (vocab, hidden), one("embedding.word_embeddings.weight", vocab, mg_vocab),
               one("model.embed_tokens.weight", vocab), one("model.embed_tokens.weight", vocab, SGLANG_VOCAB),
               region="embed"),
        norm("final_norm", hidden, "decoder.final_layernorm.weight", "model.norm.weight", "model.norm.weight",
             region="final"),
    ]
    if cfg.get("tie_word_embeddings", False):
        # Megatron keeps its own copy of the tied head on the last stage when PP > 1 (kept equal by an
        # all-reduce of gradients); HF has no separate tensor: read it from the embedding.
        rows.append(Weight("lm_head", (vocab, hidden), one("output_layer.weight", vocab, mg_vocab),
                           one("model.embed_tokens.weight", vocab, write=False), (), region="final"))
        if cfg["model_type"] == "qwen3_moe":
            # SGLang's Qwen3-MoE never ties: it has its own lm_head even when the config says tied
            # (docs/sglang-layout.md, difference 5). Fill it from the embedding.
            rows.append(Weight("lm_head_untied", (vocab, hidden),
                               one("embedding.word_embeddings.weight", vocab, mg_vocab, write=False),
                               one("model.embed_tokens.weight", vocab, write=False),
                               one("lm_head.weight", vocab, SGLANG_VOCAB), region="embed"))
    else:
        rows.append(Weight("lm_head", (vocab, hidden), one("output_layer.weight", vocab, mg_vocab),
                           one("lm_head.weight", vocab), one("lm_head.weight", vocab, SGLANG_VOCAB), region="final"))
    return rows


def gqa_rows(cfg: dict, i: int, mp: str, hp: str, names: MegatronNames, bias: bool, qk_norm: bool,
             o_bias: bool, **kw) -> list[Weight]:
    """Grouped-query attention of layer i. mp/hp: Megatron/HF(=SGLang) name prefixes of the layer."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or hidden // heads
    q, kv = heads * d, groups * d
    sg_qkv = Fused((Block(heads, d, "attention heads"), Block(groups, d, "KV heads"), Block(groups, d, "KV heads")))
    mg_qkv = GroupedQKV(heads, groups, d)
    hf_qkv = [(f"{hp}self_attn.{x}_proj", n) for x, n in (("q", q), ("k", kv), ("v", kv))]
    rows = [
        norm(f"L{i}.input_norm", hidden, names.input_norm(mp, mla=False), f"{hp}input_layernorm.weight",
             f"{hp}input_layernorm.weight", **kw),
        Weight(f"L{i}.qkv", (q + 2 * kv, hidden), one(f"{mp}self_attention.linear_qkv.weight", q + 2 * kv, mg_qkv),
               stacked([(n + ".weight", r) for n, r in hf_qkv]),
               one(f"{hp}self_attn.qkv_proj.weight", q + 2 * kv, sg_qkv), block_fp8=True, **kw),
        Weight(f"L{i}.o_proj", (hidden, q), one(f"{mp}self_attention.linear_proj.weight", hidden, ROW),
               one(f"{hp}self_attn.o_proj.weight", hidden), one(f"{hp}self_attn.o_proj.weight", hidden, ROW), block_fp8=True, **kw),
    ]
    if bias:
        rows.append(Weight(f"L{i}.qkv_bias", (q + 2 * kv,),
                           one(f"{mp}self_attention.linear_qkv.bias", q + 2 * kv, mg_qkv),
                           stacked([(n + ".bias", r) for n, r in hf_qkv]),
                           one(f"{hp}self_attn.qkv_proj.bias", q + 2 * kv, sg_qkv), **kw))
    if o_bias:
        rows.append(norm(f"L{i}.o_bias", hidden, f"{mp}self_attention.linear_proj.bias",
                         f"{hp}self_attn.o_proj.bias", f"{hp}self_attn.o_proj.bias", **kw))
    if qk_norm:
        rows.append(norm(f"L{i}.q_norm", d, f"{mp}self_attention.q_layernorm.weight", f"{hp}self_attn.q_norm.weight",
                         f"{hp}self_attn.q_norm.weight", **kw))
        rows.append(norm(f"L{i}.k_norm", d, f"{mp}self_attention.k_layernorm.weight", f"{hp}self_attn.k_norm.weight",
                         f"{hp}self_attn.k_norm.weight", **kw))
    return rows


def mla_rows(cfg: dict, i: int, mp: str, hp: str, names: MegatronNames, **kw) -> list[Weight]:
    """DeepSeek multi-latent attention, with or without q-LoRA."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    sa, hs = f"{mp}self_attention.", f"{hp}self_attn."
    heads_rule = Fused((Block(heads, nope + rope, "attention heads"),))
    kv_heads_rule = Fused((Block(heads, nope + vd, "attention heads"),))
    down = names.mla_down_rule()
    kv_a = kv_lora + rope
    rows = [norm(f"L{i}.input_norm", hidden, names.input_norm(mp, mla=True), f"{hp}input_layernorm.weight",
                 f"{hp}input_layernorm.weight", **kw)]
    if q_lora:
        # SGLang fuses q_a_proj and kv_a_proj_with_mqa into one replicated matrix; Megatron and HF keep two.
        rows.append(Weight(f"L{i}.qkv_a", (q_lora + kv_a, hidden),
                           (Part(f"{sa}linear_q_down_proj.weight", (0, q_lora), down),
                            Part(f"{sa}linear_kv_down_proj.weight", (q_lora, q_lora + kv_a), down)),
                           stacked([(f"{hs}q_a_proj.weight", q_lora), (f"{hs}kv_a_proj_with_mqa.weight", kv_a)]),
                           one(f"{hs}fused_qkv_a_proj_with_mqa.weight", q_lora + kv_a), block_fp8=True, **kw))
        rows.append(norm(f"L{i}.q_a_norm", q_lora, names.mla_q_norm(mp), f"{hs}q_a_layernorm.weight",
                         f"{hs}q_a_layernorm.weight", **kw))
        rows.append(Weight(f"L{i}.q_b", (heads * (nope + rope), q_lora),
                           one(f"{sa}linear_q_up_proj.weight", heads * (nope + rope), heads_rule),
                           one(f"{hs}q_b_proj.weight", heads * (nope + rope)),
                           one(f"{hs}q_b_proj.weight", heads * (nope + rope), heads_rule), block_fp8=True, **kw))
    else:
        rows.append(Weight(f"L{i}.q", (heads * (nope + rope), hidden),
                           one(f"{sa}linear_q_proj.weight", heads * (nope + rope), heads_rule),
                           one(f"{hs}q_proj.weight", heads * (nope + rope)),
                           one(f"{hs}q_proj.weight", heads * (nope + rope), heads_rule), block_fp8=True, **kw))
        rows.append(Weight(f"L{i}.kv_a", (kv_a, hidden), one(f"{sa}linear_kv_down_proj.weight", kv_a, down),
                           one(f"{hs}kv_a_proj_with_mqa.weight", kv_a), one(f"{hs}kv_a_proj_with_mqa.weight", kv_a),
                           block_fp8=True, **kw))
    rows += [
        norm(f"L{i}.kv_a_norm", kv_lora, names.mla_kv_norm(mp), f"{hs}kv_a_layernorm.weight",
             f"{hs}kv_a_layernorm.weight", **kw),
        Weight(f"L{i}.kv_b", (heads * (nope + vd), kv_lora),
               one(f"{sa}linear_kv_up_proj.weight", heads * (nope + vd), kv_heads_rule),
               one(f"{hs}kv_b_proj.weight", heads * (nope + vd)),
               one(f"{hs}kv_b_proj.weight", heads * (nope + vd), kv_heads_rule), block_fp8=True, **kw),
        Weight(f"L{i}.o_proj", (hidden, heads * vd), one(f"{sa}linear_proj.weight", hidden, ROW),
               one(f"{hs}o_proj.weight", hidden), one(f"{hs}o_proj.weight", hidden, ROW), block_fp8=True, **kw),
    ]
    return rows


def dense_mlp_rows(cfg: dict, i: int, mp: str, hp: str, names: MegatronNames, inter: int, **kw) -> list[Weight]:
    hidden = cfg["hidden_size"]
    g = gated(inter, "intermediate size")
    return [
        norm(f"L{i}.post_norm", hidden, names.pre_mlp_norm(mp, moe=False), f"{hp}post_attention_layernorm.weight",
             f"{hp}post_attention_layernorm.weight", **kw),
        Weight(f"L{i}.gate_up", (2 * inter, hidden), one(f"{mp}mlp.linear_fc1.weight", 2 * inter, g),
               stacked([(f"{hp}mlp.gate_proj.weight", inter), (f"{hp}mlp.up_proj.weight", inter)]),
               one(f"{hp}mlp.gate_up_proj.weight", 2 * inter, g), block_fp8=True, **kw),
        Weight(f"L{i}.down", (hidden, inter), one(f"{mp}mlp.linear_fc2.weight", hidden, ROW),
               one(f"{hp}mlp.down_proj.weight", hidden), one(f"{hp}mlp.down_proj.weight", hidden, ROW), block_fp8=True, **kw),
    ]


def moe_rows(cfg: dict, i: int, mp: str, hp: str, names: MegatronNames, experts: int, inter: int,
             shared_inter: int = 0, expert_bias: bool = False, **kw) -> list[Weight]:
    """Router, routed experts (one row per expert and matrix) and optional shared experts of layer i."""
    hidden = cfg["hidden_size"]
    g = gated(inter, "moe_intermediate_size")
    rows = [
        norm(f"L{i}.post_norm", hidden, names.pre_mlp_norm(mp, moe=True), f"{hp}post_attention_layernorm.weight",
             f"{hp}post_attention_layernorm.weight", **kw),
        Weight(f"L{i}.router", (experts, hidden), one(f"{mp}mlp.router.weight", experts),
               one(f"{hp}mlp.gate.weight", experts), one(f"{hp}mlp.gate.weight", experts), **kw),
    ]
    if expert_bias:
        # float32 in Megatron (a router buffer) and in SGLang (e_score_correction_bias): never cast to bf16.
        rows.append(norm(f"L{i}.expert_bias", experts, f"{mp}mlp.router.expert_bias",
                         f"{hp}mlp.gate.e_score_correction_bias", f"{hp}mlp.gate.e_score_correction_bias", fp32=True,
                         **kw))
    for e in range(experts):
        ep = f"{hp}mlp.experts.{e}."
        rows.append(Weight(f"L{i}.E{e}.gate_up", (2 * inter, hidden),
                           one(names.expert(mp, "linear_fc1"), 2 * inter, g),
                           stacked([(f"{ep}gate_proj.weight", inter), (f"{ep}up_proj.weight", inter)]),
                           one(f"{hp}mlp.experts.w13_weight", 2 * inter, g, slot=True), expert=e, block_fp8=True, **kw))
        rows.append(Weight(f"L{i}.E{e}.down", (hidden, inter), one(names.expert(mp, "linear_fc2"), hidden, ROW),
                           one(f"{ep}down_proj.weight", hidden),
                           one(f"{hp}mlp.experts.w2_weight", hidden, ROW, slot=True), expert=e, block_fp8=True, **kw))
    if shared_inter:
        sg = gated(shared_inter, "shared expert intermediate size")
        sp, hsp = f"{mp}mlp.shared_experts.", f"{hp}mlp.shared_experts."
        rows.append(Weight(f"L{i}.shared.gate_up", (2 * shared_inter, hidden),
                           one(f"{sp}linear_fc1.weight", 2 * shared_inter, sg),
                           stacked([(f"{hsp}gate_proj.weight", shared_inter), (f"{hsp}up_proj.weight", shared_inter)]),
                           one(f"{hsp}gate_up_proj.weight", 2 * shared_inter, sg), block_fp8=True, **kw))
        rows.append(Weight(f"L{i}.shared.down", (hidden, shared_inter), one(f"{sp}linear_fc2.weight", hidden, ROW),
                           one(f"{hsp}down_proj.weight", hidden), one(f"{hsp}down_proj.weight", hidden, ROW), block_fp8=True, **kw))
    return rows
