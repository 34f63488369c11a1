"""HF ``config.json`` (a dict) -> Megatron-core ``TransformerConfig`` fields and ``GPTModel`` arguments.

Every field that changes numerics is mapped here and nowhere else. Fields HF has that Megatron cannot
express the same way raise ``ModelConfigError`` naming the field (never a silent approximation).
Accepts both on-disk configs (``rope_theta``, ``rope_scaling``) and transformers-5 dicts
(``rope_parameters``). The RoPE fields (plain, llama3, yarn) have their own table in mtrain.models.hf_rope.

Common to all six architectures (llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3)
--------------------------------------------------------------------------------------
| HF field                         | Megatron field                                         |
|----------------------------------|--------------------------------------------------------|
| num_hidden_layers                | num_layers                                             |
| hidden_size                      | hidden_size                                            |
| num_attention_heads              | num_attention_heads                                    |
| num_key_value_heads              | num_query_groups (GQA; MLA: = num_attention_heads)     |
| head_dim (else hidden/heads)     | kv_channels                                            |
| intermediate_size                | ffn_hidden_size (dense layers)                         |
| rms_norm_eps                     | layernorm_epsilon, normalization="RMSNorm"             |
| hidden_act == "silu"             | activation_func=F.silu, gated_linear_unit=True (SwiGLU)|
| rope_theta / rope_parameters     | GPTModel(rotary_base=...), position_embedding_type=rope|
| rope_scaling (llama3, yarn)      | mtrain.models.hf_rope                                  |
| max_position_embeddings          | GPTModel(max_sequence_length=...)                      |
| vocab_size                       | GPTModel(vocab_size=padded_vocab_size(...)); logits cut|
| tie_word_embeddings              | GPTModel(share_embeddings_and_output_weights=...)      |
| initializer_range                | init_method_std                                        |
| attention_dropout (must be 0)    | attention_dropout=0, hidden_dropout=0                  |
| (no biases)                      | add_bias_linear=False                                  |

all:     dual_chunk_attention_config, rope_is_neox_style=False -> error (SGLang alone reads them).
llama:   attention_bias -> add_qkv_bias (o_proj bias unsupported -> error); mlp_bias, bias -> error if true.
mistral: llama's fields, no biases (attention_bias/bias true -> error); sliding_window null or >=
         max_position_embeddings (it never applies), else error (mtrain computes full causal attention).
qwen2:   add_qkv_bias=True (HF Qwen2 always has q/k/v bias, no o_proj bias); sliding window -> error if used.
qwen3:   qk_layernorm=True (RMSNorm over head_dim: q_norm/k_norm); attention_bias -> add_qkv_bias.
qwen3_moe (qwen3 +):
| num_experts (num_local_experts)  | num_moe_experts                                        |
| moe_intermediate_size            | moe_ffn_hidden_size                                    |
| num_experts_per_tok              | moe_router_topk                                        |
| norm_topk_prob                   | True: moe_router_pre_softmax=False (top-k of logits,   |
|                                  | softmax over the k = renormalised); False: pre_softmax |
| decoder_sparse_step, mlp_only_layers | moe_layer_freq (list: 1 = MoE layer, 0 = dense)    |
| (router: softmax)                | moe_router_score_function="softmax"                    |
| router_aux_loss_coef             | not mapped: aux loss off (moe_router_load_balancing_type="none") |
deepseek_v3 (MLATransformerConfig):
| q_lora_rank (None -> linear_q_proj) | q_lora_rank                                         |
| kv_lora_rank                     | kv_lora_rank                                           |
| qk_nope_head_dim                 | qk_head_dim                                            |
| qk_rope_head_dim                 | qk_pos_emb_head_dim                                    |
| v_head_dim                       | v_head_dim                                             |
| (q_a_layernorm, kv_a_layernorm)  | qk_layernorm=True (q_layernorm / kv_layernorm)         |
| rope_interleave (default True)   | always on in Megatron MLA (False -> error)             |
| rope_scaling yarn                | mtrain.models.hf_rope (rope_type="yarn", ...)          |
| (no scaling)                     | rope_type="rope", mscale_all_dim=0 (scale 1/sqrt(q_dim))|
| n_routed_experts                 | num_moe_experts                                        |
| moe_intermediate_size            | moe_ffn_hidden_size                                    |
| n_shared_experts                 | moe_shared_expert_intermediate_size = n * moe_inter.   |
| num_experts_per_tok              | moe_router_topk                                        |
| (sigmoid router, e_score_correction_bias) | moe_router_score_function="sigmoid",          |
|                                  | moe_router_enable_expert_bias=True                     |
| n_group / topk_group             | moe_router_num_groups / moe_router_group_topk (HF sums |
|                                  | the top-2 per group; Megatron topk//topk_group: must =2)|
| routed_scaling_factor            | moe_router_topk_scaling_factor                         |
| norm_topk_prob (must be True)    | Megatron's sigmoid router always renormalises          |
| first_k_dense_replace, moe_layer_freq | moe_layer_freq list                               |
| num_nextn_predict_layers         | mtp_num_layers (None when 0)                           |
qwen2_5_vl (qwen2's decoder; text fields at the top or in text_config, mtrain.layouts.vlm.flat_config):
| rope_scaling / rope_parameters .mrope_section | mrope_section, position_embedding_type="mrope" |
|                                  | (sections sum to head_dim/2; other rope types -> error)|
| (head_dim ignored by HF)         | kv_channels = hidden_size / num_attention_heads        |
| vision_config, image_token_id    | VisionLanguageModel(vision_config=..., image_token_id=...): the transformers vision |
|                                  | tower on the first stage (mtrain/models/vlm.py)        |
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mtrain.models.config_error import ModelConfigError
from mtrain.models.hf_rope import gqa_rope, mla_yarn, rope_of

# model_type -> the model class config.json's "architectures" names. SGLang 0.5.17 picks its model class by
# hf_config.architectures[0] and dies at start on a config without the key (a TypeError, nothing more); the
# converters write it into every config.json they produce (converters/hf_config_file.py).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def with_architectures(hf_config: dict) -> dict:
    """`hf_config` with `architectures` filled in from its model_type where it is missing or empty."""
    if hf_config.get("architectures") or hf_config.get("model_type") not in ARCHITECTURES:
        return hf_config
    return {**hf_config, "architectures": [ARCHITECTURES[hf_config["model_type"]]]}


@dataclass(frozen=True)
class MappedConfig:
    """What building a GPTModel needs, before parallel sizes are added."""

    model_type: str
    mla: bool  # True -> MLATransformerConfig
    config_kwargs: dict[str, Any]
    model_kwargs: dict[str, Any]  # GPTModel arguments except config/spec/vocab/pre/post
    vocab_size: int  # unpadded, as HF has it
    notes: list[str] = field(default_factory=list)
    vision: bool = False  # a vision-language model: built as mtrain.models.vlm.VisionLanguageModel


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: pad the vocabulary to a multiple of ``divisible_by * tp`` rows."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def _req(hf: dict, key: str, model_type: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ModelConfigError(f"{model_type} config.json is missing required field '{key}'")
    return hf[key]


def _common(hf: dict, mt: str) -> tuple[dict, dict]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act={act!r} is not supported (only 'silu' with a gated MLP)")
    if hf.get("attention_dropout", 0.0):
        raise ModelConfigError("attention_dropout must be 0 (RL recomputes logprobs deterministically)")
    if hf.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=True is not supported (Megatron has one add_bias_linear switch)")
    if hf.get("use_sliding_window"):
        raise ModelConfigError("use_sliding_window=True is not supported: mtrain's packed attention computes full "
                               "causal attention (docs/design-trainer.md, 'Model options refused at load')")
    if hf.get("dual_chunk_attention_config"):  # Qwen2.5-7B/14B-Instruct-1M
        raise ModelConfigError(f"{mt} dual_chunk_attention_config is not supported: SGLang then computes dual-chunk "
                               f"attention past chunk_size on its dual_chunk_flash_attn backend only, transformers and "
                               f"mtrain full attention; delete the field (full attention, as transformers computes)")
    if hf.get("rope_is_neox_style") is False:
        raise ModelConfigError(f"{mt} rope_is_neox_style=False is not supported: SGLang's Llama then rotates "
                               f"interleaved pairs, transformers and Megatron rotate halves")
    heads = int(_req(hf, "num_attention_heads", mt))
    hidden = int(_req(hf, "hidden_size", mt))
    cfg = dict(
        num_layers=int(_req(hf, "num_hidden_layers", mt)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(_req(hf, "intermediate_size", mt)),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # HF computes softmax in fp32 and applies no per-layer query-key scaling.
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
    )
    theta, _ = rope_of(hf)
    model = dict(
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
    )
    return cfg, model


def _map_llama(hf: dict) -> MappedConfig:
    cfg, model = _common(hf, "llama")
    if hf.get("attention_bias"):
        raise ModelConfigError("llama attention_bias=True is not supported (HF also biases o_proj; Megatron cannot)")
    if hf.get("bias"):  # InternLM's field: transformers' Llama ignores it
        raise ModelConfigError("llama bias=True is not supported: SGLang's Llama then biases q/k/v/o_proj, "
                               "transformers' Llama has no biases")
    gqa_rope(hf, "llama", cfg, model)
    return MappedConfig("llama", False, cfg, model, int(_req(hf, "vocab_size", "llama")))


def _map_mistral(hf: dict) -> MappedConfig:
    """Llama's architecture with an optional sliding window. mtrain's packed attention computes full causal attention
    (so does SGLang's MistralForCausalLM, its Llama class): taken where the window never applies."""
    mt = "mistral"
    cfg, model = _common(hf, mt)
    window, context = hf.get("sliding_window"), model["max_sequence_length"]
    if window is not None and int(window) < context:
        raise ModelConfigError(f"mistral sliding_window={window} is not supported: mtrain's packed attention computes "
                               f"full causal attention; sliding_window null, or max_position_embeddings ({context}) "
                               f"or more, never applies and loads")
    for key in ("attention_bias", "bias"):
        if hf.get(key):
            raise ModelConfigError(f"mistral {key}={hf[key]!r} is not supported: transformers' Mistral has no "
                                   f"attention biases, SGLang's reads them")
    gqa_rope(hf, mt, cfg, model)
    return MappedConfig(mt, False, cfg, model, int(_req(hf, "vocab_size", mt)))


def _map_qwen2(hf: dict) -> MappedConfig:
    cfg, model = _common(hf, "qwen2")
    cfg["add_qkv_bias"] = True  # Qwen2Attention: q/k/v_proj bias=True, o_proj bias=False, unconditionally
    gqa_rope(hf, "qwen2", cfg, model)
    return MappedConfig("qwen2", False, cfg, model, int(_req(hf, "vocab_size", "qwen2")))


def _map_qwen3(hf: dict, mt: str = "qwen3") -> MappedConfig:
    cfg, model = _common(hf, mt)
    if hf.get("attention_bias"):
        raise ModelConfigError(f"{mt} attention_bias=True is not supported (HF also biases o_proj; Megatron cannot)")
    cfg["qk_layernorm"] = True
    gqa_rope(hf, mt, cfg, model)
    return MappedConfig(mt, False, cfg, model, int(_req(hf, "vocab_size", mt)))


def _map_qwen3_moe(hf: dict) -> MappedConfig:
    base = _map_qwen3(hf, "qwen3_moe")
    cfg = dict(base.config_kwargs)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ModelConfigError("qwen3_moe config.json is missing 'num_experts'")
    n = cfg["num_layers"]
    step = int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or [])
    freq = [0 if (i in dense_only or (i + 1) % step != 0) else 1 for i in range(n)]
    cfg.update(
        num_moe_experts=int(experts),
        moe_ffn_hidden_size=int(_req(hf, "moe_intermediate_size", "qwen3_moe")),
        moe_router_topk=int(_req(hf, "num_experts_per_tok", "qwen3_moe")),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
        moe_layer_freq=freq,
    )
    cfg.update(_MOE_RUNTIME)
    return MappedConfig("qwen3_moe", False, cfg, base.model_kwargs, base.vocab_size)


# MoE settings that are not model facts but make Megatron compute what HF computes, on CPU and GPU.
_MOE_RUNTIME = dict(
    moe_router_load_balancing_type="none",  # no aux loss in the forward; RL losses add none either
    moe_aux_loss_coeff=0.0,
    moe_router_dtype="fp32",  # HF routers run their gate in fp32 (DeepSeek) or compare fp32 softmax
    moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=False,  # local spec: SequentialMLP (per-expert linear_fc1/fc2)
    moe_permute_fusion=False,
    moe_router_fusion=False,
)


def _map_deepseek_v3(hf: dict) -> MappedConfig:
    mt = "deepseek_v3"
    cfg, model = _common(hf, mt)
    if not hf.get("rope_interleave", True):
        raise ModelConfigError("deepseek_v3 rope_interleave=False is not supported (Megatron MLA de-interleaves)")
    if hf.get("attention_bias"):
        raise ModelConfigError("deepseek_v3 attention_bias=True is not supported")
    heads = cfg["num_attention_heads"]
    cfg["num_query_groups"] = heads  # MLA: every head has its own (decompressed) K and V
    cfg.pop("kv_channels")
    q_lora = hf.get("q_lora_rank")
    cfg.update(
        multi_latent_attention=True,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_req(hf, "kv_lora_rank", mt)),
        qk_head_dim=int(_req(hf, "qk_nope_head_dim", mt)),
        qk_pos_emb_head_dim=int(_req(hf, "qk_rope_head_dim", mt)),
        v_head_dim=int(_req(hf, "v_head_dim", mt)),
        kv_channels=int(_req(hf, "v_head_dim", mt)),
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm on the low-rank latents
        rotary_base=model["rotary_base"],
    )
    _, scaling = rope_of(hf)
    if scaling is None:
        cfg.update(rope_type="rope", mscale_all_dim=0.0, mscale=1.0, rotary_scaling_factor=1.0)
    elif scaling["rope_type"] == "yarn":
        cfg.update(mla_yarn(scaling))
    else:
        raise ModelConfigError(f"deepseek_v3 rope_scaling rope_type={scaling['rope_type']!r} is not supported (yarn only)")
    model["position_embedding_type"] = "none"  # MLA applies its own rotary embedding inside attention
    experts = hf.get("n_routed_experts")
    if experts:
        topk = int(_req(hf, "num_experts_per_tok", mt))
        if not hf.get("norm_topk_prob", True):
            raise ModelConfigError("deepseek_v3 norm_topk_prob=False is not supported (Megatron's sigmoid router renormalises)")
        if hf.get("topk_method", "noaux_tc") not in ("noaux_tc",):
            raise ModelConfigError(f"deepseek_v3 topk_method={hf.get('topk_method')!r} is not supported (noaux_tc only)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelConfigError(f"deepseek_v3 scoring_func={hf.get('scoring_func')!r} is not supported (sigmoid only)")
        n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
        group_kwargs: dict[str, Any] = {}
        if n_group and int(n_group) > 1:
            if not topk_group or int(experts) % int(n_group) or int(experts) // int(n_group) < 2:
                raise ModelConfigError(f"deepseek_v3 n_routed_experts={experts} in n_group={n_group} groups with "
                                       f"topk_group={topk_group}: each group must hold 2 experts or more (both sides "
                                       "score a group by its top 2) and topk_group must be set")
            if topk // int(topk_group) != 2:
                raise ModelConfigError(
                    f"deepseek_v3 num_experts_per_tok/topk_group = {topk}/{topk_group} must be 2: HF scores a group by "
                    "its top-2 experts, Megatron by its top-(topk/topk_group)"
                )
            group_kwargs = dict(moe_router_num_groups=int(n_group), moe_router_group_topk=int(topk_group))
        first_dense = int(hf.get("first_k_dense_replace", 0))
        every = int(hf.get("moe_layer_freq", 1))
        if every != 1:  # transformers' DeepseekV3 has no such field: every layer from first_k_dense_replace is MoE
            raise ModelConfigError(f"deepseek_v3 moe_layer_freq={every} is not supported: transformers makes every "
                                   "layer from first_k_dense_replace on a MoE layer, SGLang one in "
                                   f"{every}")
        n = cfg["num_layers"]
        freq = [1 if (i >= first_dense and i % every == 0) else 0 for i in range(n)]
        shared = int(hf.get("n_shared_experts") or 0)
        moe_inter = int(_req(hf, "moe_intermediate_size", mt))
        cfg.update(
            num_moe_experts=int(experts),
            moe_ffn_hidden_size=moe_inter,
            moe_shared_expert_intermediate_size=shared * moe_inter if shared else None,
            moe_router_topk=topk,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_layer_freq=freq,
            **group_kwargs,
        )
        cfg.update(_MOE_RUNTIME)
    mtp = int(hf.get("num_nextn_predict_layers") or 0)
    cfg["mtp_num_layers"] = mtp if mtp > 0 else None
    return MappedConfig(mt, True, cfg, model, int(_req(hf, "vocab_size", mt)))


def _map_qwen2_5_vl(hf: dict) -> MappedConfig:
    from mtrain.layouts.vlm import flat_config
    mt = "qwen2_5_vl"
    flat = flat_config(hf)
    cfg, model = _common(flat, mt)
    cfg["add_qkv_bias"] = True  # Qwen2_5_VLAttention: q/k/v_proj bias=True, o_proj bias=False
    cfg["kv_channels"] = cfg["hidden_size"] // cfg["num_attention_heads"]  # HF ignores a head_dim field here
    params = dict(flat.get("rope_parameters") or {})
    params.update(flat.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type"))
    if kind not in (None, "default", "mrope"):
        raise ModelConfigError(f"{mt} rope type {kind!r} is not supported (multimodal RoPE without scaling only)")
    section = params.get("mrope_section")
    if not section or len(section) != 3:
        raise ModelConfigError(f"{mt} config.json needs rope_scaling.mrope_section with 3 entries, got {section!r}")
    if sum(section) != cfg["kv_channels"] // 2:
        raise ModelConfigError(f"{mt} mrope_section {section} sums to {sum(section)}, not head_dim/2 = "
                               f"{cfg['kv_channels'] // 2}")
    cfg["mrope_section"] = [int(x) for x in section]
    model["position_embedding_type"] = "mrope"
    model["vision_config"] = dict(_req(flat, "vision_config", mt))
    model["image_token_id"] = int(_req(flat, "image_token_id", mt))
    return MappedConfig(mt, False, cfg, model, int(_req(flat, "vocab_size", mt)), vision=True)


_MAPPERS = {
    "llama": _map_llama,
    "mistral": _map_mistral,
    "qwen2": _map_qwen2,
    "qwen3": _map_qwen3,
    "qwen3_moe": _map_qwen3_moe,
    "deepseek_v3": _map_deepseek_v3,
    "qwen2_5_vl": _map_qwen2_5_vl,
}


def map_hf_config(hf_config: dict) -> MappedConfig:
    """Map a HF config dict; raises ModelConfigError naming the field for anything unsupported."""
    mt = hf_config.get("model_type")
    if mt not in _MAPPERS:
        raise ModelConfigError(f"model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        mapped = _MAPPERS[mt](hf_config)
    except ModelConfigError:
        raise
    except Exception:  # a field left out made the mapping fail (int(None)): name it
        _check_unstated_fields(hf_config)
        raise
    _check_unstated_fields(hf_config)
    return mapped


# mapped values that do not change the forward pass of loaded weights
_NOT_NUMERICS = ("max_sequence_length", "init_method_std")


def _mapped_or_error(hf: dict) -> Any:
    try:
        m = _MAPPERS[hf["model_type"]](hf)
    except Exception as e:  # a field left out can make the mapping itself fail (int(None))
        return type(e).__name__
    drop = lambda d: {k: v for k, v in d.items() if k not in _NOT_NUMERICS}  # noqa: E731
    return drop(m.config_kwargs), drop(m.model_kwargs)


def _check_unstated_fields(hf: dict) -> None:
    """A field config.json leaves out is what transformers' config class makes of it (its default, or a value
    derived from the other fields): transformers and SGLang compute with that. Where the mapping would assume
    another value (n_group, first_k_dense_replace, q_lora_rank, routed_scaling_factor of DeepSeek-V3; head_dim and
    num_key_value_heads of Qwen2/3 ...), the field is refused by name: never built from a value HF does not use."""
    if hf.get("model_type") == "qwen2_5_vl":  # its text fields may sit in text_config (layouts.vlm.flat_config)
        return
    try:
        import transformers
        level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            full = transformers.AutoConfig.for_model(**copy.deepcopy(hf)).to_dict()  # it fills rope_scaling in place
        finally:
            transformers.logging.set_verbosity(level)
    except Exception:  # transformers cannot read the config itself: the mapping names what it can
        return
    base = _mapped_or_error(hf)
    for key, value in full.items():
        if key not in hf and _mapped_or_error({**hf, key: value}) != base:
            raise ModelConfigError(
                f"{hf['model_type']} config.json has no '{key}': transformers then uses {key}={value!r}, which mtrain "
                f"would not assume; write the model's value of '{key}' into config.json")


def context_length(hf_config: dict) -> int | None:
    """The model's context: max_position_embeddings (a VLM's text model's), None where config.json has none. A
    prompt plus its new tokens past it is refused by the rollout and the reference engine (rope_scaling does not
    raise it: HF configs that extend the context state the extended length here)."""
    from mtrain.layouts.vlm import flat_config
    return flat_config(hf_config).get("max_position_embeddings")


def dtype_flags(params_dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig precision flags for a parameter dtype."""
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelConfigError(f"params_dtype={params_dtype} is not supported (float32, bfloat16, float16)")
    return dict(
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
