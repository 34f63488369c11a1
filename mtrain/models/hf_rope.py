"""RoPE fields of a HF config.json -> Megatron-core, for mtrain.models.hf_config: plain, llama3 and yarn RoPE of the
GQA models (llama, mistral, qwen2, qwen3, qwen3_moe) and yarn of DeepSeek-V3's MLA.

Three programs compute with these fields: transformers (the reference, modeling_rope_utils.py), Megatron-core (the
trainer) and SGLang 0.5.17 (the engines, layers/rotary_embedding/). A field that one of them reads otherwise than
the others is refused by name (ModelConfigError), never approximated.

| HF rope_scaling / rope_parameters  | Megatron                                                              |
|------------------------------------|-----------------------------------------------------------------------|
| none, or rope_type "default"       | GPTModel(position_embedding_type="rope", rotary_base=rope_theta)      |
| llama3: factor, low_freq_factor=1, | GPTModel(rope_scaling=True, rope_scaling_factor=factor); Megatron     |
|   high_freq_factor=4, original_max_position_embeddings=8192 | hard-codes the other three (other values -> error) |
| yarn (GQA): factor, original_max_position_embeddings (default max_position_embeddings), beta_fast,         |
|   beta_slow, truncate, mscale, mscale_all_dim | GPTModel(position_embedding_type="yarn") and the TransformerConfig |
|                                    | attributes YARN_CONFIG_ATTRS (cos/sin scaled by the same factor)      |
| yarn (MLA): the same fields        | MLATransformerConfig(rope_type="yarn", rotary_scaling_factor, ...,    |
|                                    | mscale, mscale_all_dim); softmax scale                                |
|                                    | mscale(factor, mscale_all_dim)^2 / sqrt(q_dim)                        |
| partial_rotary_factor (must be 1)  | rotary_percent=1.0                                                    |
"""
from __future__ import annotations

import math

from mtrain.models.config_error import ModelConfigError

# megatron-core 0.19 reads a GQA model's yarn settings from TransformerConfig attributes the dataclass does not
# declare (GPTModel's yarn branch; Attention's concentration factor, which scales cos/sin); its own argument parser
# sets them on the built config the same way (megatron/training/argument_utils.py). make_transformer_config does.
YARN_CONFIG_ATTRS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                     "yarn_beta_slow", "yarn_correction_range_round_to_int", "yarn_mscale", "yarn_mscale_all_dim")


def rope_of(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config style, read as transformers 5 reads them (SGLang 0.5.17
    computes with transformers' config object): a non-empty rope_scaling replaces rope_parameters whole, and the
    theta inside the chosen dict wins over a top-level rope_theta (10000 where neither states one). Both styles in
    one file with different values (a transformers-5 config.json, whose rope_theta sits in rope_parameters, given
    the rope_scaling block of a model card) are refused: transformers would drop the values the file states."""
    mt = hf.get("model_type")
    stated, legacy = hf.get("rope_parameters") or None, hf.get("rope_scaling") or None
    params = dict(legacy or stated or {})
    top = hf.get("rope_theta")
    theta = float(params.get("rope_theta", 10000.0 if top is None else top))
    if top is not None and float(top) != theta:
        where = "rope_scaling" if legacy else "rope_parameters"
        raise ModelConfigError(f"{mt} config.json states rope_theta={top} at the top and rope_theta="
                               f"{params['rope_theta']} in {where}: transformers and SGLang use {where}'; keep one")
    if legacy and stated:
        kind = params.get("rope_type", params.get("type", "default"))
        # what transformers fills in where rope_scaling leaves a key out (its to_dict() writes these back)
        filled = {"rope_theta": theta, "rope_type": kind, "type": kind,
                  "original_max_position_embeddings": hf.get("original_max_position_embeddings",
                                                             hf.get("max_position_embeddings"))}
        lost = {k: v for k, v in stated.items() if params.get(k, filled.get(k)) != v
                and not (k in ("rope_type", "type") and v in ("default", None))}
        if lost:
            raise ModelConfigError(f"{mt} config.json has both rope_scaling and rope_parameters: transformers and "
                                   f"SGLang read rope_scaling alone (rope_theta={theta:g}) and drop rope_parameters' "
                                   f"{', '.join(f'{k}={v!r}' for k, v in lost.items())}; put the rope_scaling keys "
                                   f"into rope_parameters and delete rope_scaling")
    scaling = params or None
    if scaling is not None:
        scaling.setdefault("rope_type", scaling.get("type"))
        if scaling["rope_type"] in ("default", None):
            scaling = None
    return theta, scaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def gqa_rope(hf: dict, mt: str, cfg: dict, model: dict) -> None:
    """A GQA model's RoPE scaling into its TransformerConfig kwargs `cfg` and GPTModel kwargs `model` (which holds
    max_sequence_length already)."""
    _, scaling = rope_of(hf)
    for where in (hf, hf.get("rope_parameters") or {}, scaling or {}):
        part = where.get("partial_rotary_factor")
        if part is not None and float(part) != 1.0:
            raise ModelConfigError(f"{mt} partial_rotary_factor={part} is not supported (RoPE over the whole head_dim "
                                   f"only)")
    if scaling is None:
        return
    kind = scaling["rope_type"]
    if kind == "llama3":
        model.update(_llama3(scaling))
    elif kind == "yarn":
        cfg.update(_gqa_yarn(hf, scaling, mt, model["max_sequence_length"]))
        model["position_embedding_type"] = "yarn"
    else:
        raise ModelConfigError(f"{mt} rope_scaling rope_type={kind!r} is not supported (llama3 and yarn only)")


def yarn_original_length(hf, scaling, max_positions: int) -> int:
    """The original context length yarn scales from: transformers (and SGLang, which reads transformers' config
    object) prefer a top-level original_max_position_embeddings, then rope_scaling's, then max_position_embeddings."""
    top = hf.get("original_max_position_embeddings")
    return int(top if top is not None else scaling.get("original_max_position_embeddings") or max_positions)


def _llama3(scaling: dict) -> dict:
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, want in fixed.items():
        if float(scaling.get(key, want)) != want:
            raise ModelConfigError(
                f"rope_scaling {key}={scaling.get(key)} is not supported: Megatron's llama3 scaling fixes it to {want}"
            )
    return dict(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))


def _gqa_yarn(hf: dict, s: dict, mt: str, max_positions: int) -> dict:
    """The yarn attributes of a GQA model's TransformerConfig. The frequencies are one formula in all three programs
    (factor, original length, beta_fast/beta_slow, truncate); the cos/sin scale, the defaults and a few extra keys
    are not, and are checked here."""
    if not s.get("factor"):
        raise ModelConfigError(f"{mt} rope_scaling (yarn) needs 'factor': transformers then takes "
                               f"max_position_embeddings / original_max_position_embeddings, SGLang 1")
    factor = float(s["factor"])
    for key in ("attn_factor", "extrapolation_factor"):
        if key in s and s[key] != 1:
            raise ModelConfigError(f"{mt} rope_scaling {key}={s[key]!r} is not supported: SGLang applies it, "
                                   f"transformers and Megatron do not")
    for key, default in (("beta_fast", 32), ("beta_slow", 1)):
        if key in s and not s[key]:
            raise ModelConfigError(f"{mt} rope_scaling {key}={s[key]!r} is not supported: transformers computes with "
                                   f"{default} in its place, SGLang with {s[key]!r}")
    # cos/sin scale: Megatron (given both values as they are) and SGLang take the mscale ratio where both are set,
    # transformers where both are non-zero, and an explicit attention_factor instead (SGLang does not read it).
    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    ours = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m is not None and m_all is not None \
        else yarn_mscale(factor)
    theirs = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) else yarn_mscale(factor)
    what = f"mscale={m!r} with mscale_all_dim={m_all!r}"
    if s.get("attention_factor") is not None:
        theirs, what = float(s["attention_factor"]), f"attention_factor={s['attention_factor']!r}"
    if abs(ours - theirs) > 1e-9 * abs(theirs):
        raise ModelConfigError(f"{mt} rope_scaling {what} is not supported: transformers scales cos/sin by "
                               f"{theirs:.6g}, Megatron and SGLang by {ours:.6g}")
    original = yarn_original_length(hf, s, max_positions)
    table = math.ceil(original * factor)
    if max_positions > table:
        raise ModelConfigError(f"{mt} max_position_embeddings={max_positions} is more than rope_scaling's "
                               f"original_max_position_embeddings x factor = {table}, the positions SGLang's yarn "
                               f"cos/sin table holds (layers/rotary_embedding/yarn.py): lower it to {table} at most")
    return dict(
        yarn_rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(s.get("beta_fast") or 32),
        yarn_beta_slow=float(s.get("beta_slow") or 1),
        yarn_correction_range_round_to_int=bool(s.get("truncate", True)),
        yarn_mscale=None if m is None else float(m),
        yarn_mscale_all_dim=None if m_all is None else float(m_all),
    )


def mla_yarn(scaling: dict) -> dict:
    """MLA's yarn fields. Megatron (and SGLang) scale cos/sin by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), mscale defaulting to 1 and mscale_all_dim to 0; transformers does so only where both are set,
    else by mscale(factor), and takes attention_factor and truncate=false, which neither of the others reads."""
    if not scaling.get("factor"):
        raise ModelConfigError("deepseek_v3 rope_scaling (yarn) needs 'factor'")
    factor = float(scaling["factor"])
    for key, fine in (("attention_factor", scaling.get("attention_factor") is None),
                      ("truncate", scaling.get("truncate", True) is not False)):
        if not fine:
            raise ModelConfigError(f"deepseek_v3 rope_scaling {key}={scaling[key]!r} is not supported: transformers "
                                   f"applies it, Megatron's and SGLang's yarn do not")
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    ours = yarn_mscale(factor, float(1.0 if m is None else m)) / yarn_mscale(factor, float(m_all or 0.0))
    hf = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) else yarn_mscale(factor)
    if abs(ours - hf) > 1e-9 * hf:
        raise ModelConfigError(f"deepseek_v3 rope_scaling mscale={m!r} with mscale_all_dim={m_all!r} is not supported: "
                               f"transformers scales cos/sin by {hf:.6g}, Megatron and SGLang by {ours:.6g}")
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast") or 32),  # transformers: `or 32`, `or 1`
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(1.0 if m is None else m),
        mscale_all_dim=float(m_all or 0.0),
    )
