"""A config.json field left out means transformers' value for it (its config class's default, or one derived from
the other fields): transformers and SGLang compute with that. Where mtrain would have built another model from the
same file (DeepSeek-V3 without n_group: no expert groups, where transformers routes within 8; Qwen3 without
head_dim: hidden/heads, where transformers takes 128), the field is refused by name, before any work."""
from __future__ import annotations

import json
import math

import pytest
from hf_real_configs import QWEN3_YARN, REAL, REFUSED, shrink, transformers5_form

from mtrain.models.hf_config import ModelConfigError, map_hf_config
from mtrain.tiny_configs import TINY, numerics_config, tiny_config

LEFT_OUT = [("deepseek_v3", "n_group", 8), ("deepseek_v3", "topk_group", 4), ("deepseek_v3", "first_k_dense_replace", 3),
            ("deepseek_v3", "routed_scaling_factor", 2.5), ("deepseek_v3", "n_shared_experts", 1),
            ("deepseek_v3", "q_lora_rank", 1536), ("qwen3", "head_dim", 128), ("qwen2", "num_key_value_heads", 32),
            ("qwen3_moe", "num_key_value_heads", 4)]


@pytest.mark.parametrize("arch, key, hf_value", LEFT_OUT, ids=[f"{a}-{k}" for a, k, _ in LEFT_OUT])
def test_a_left_out_field_that_transformers_fills_otherwise_is_refused(arch, key, hf_value):
    from transformers import AutoConfig
    cfg = tiny_config(arch)
    del cfg[key]
    assert AutoConfig.for_model(**cfg).to_dict()[key] == hf_value  # what transformers computes with
    want = f"no '{key}': transformers then uses {key}={hf_value}"
    if key == "topk_group":  # the group check names it first
        want = "topk_group=None: .* topk_group must be set"
    with pytest.raises(ModelConfigError, match=want) as e:
        map_hf_config(cfg)  # was: a model built from another value (or a TypeError for topk_group)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_only_layers",
                                 "norm_topk_prob", "decoder_sparse_step", "max_position_embeddings"])
def test_a_left_out_field_with_the_same_value_is_not_refused(key):
    cfg = tiny_config("qwen3_moe")
    cfg.pop(key)
    map_hf_config(cfg)


@pytest.mark.parametrize("name", sorted(n for n in TINY if not n.startswith("qwen2_5_vl")))
def test_complete_configs_map(name):
    map_hf_config(tiny_config(name))
    if name in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"):
        map_hf_config(numerics_config(name))


def test_preflight_names_the_field_in_one_line(tmp_path):
    from mtrain.config import ConfigError, load_config
    from mtrain.preflight import preflight
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("deepseek_v3", tmp_path / "dsv3", overrides={"n_routed_experts": 16, "n_group": 8,
                                                                    "topk_group": 4})
    cfg = json.loads((hf / "config.json").read_text())
    del cfg["n_group"], cfg["topk_group"]
    (hf / "config.json").write_text(json.dumps(cfg))
    from pathlib import Path
    config = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    run = load_config(config, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^model\.hf_path: deepseek_v3 config.json has no 'n_group'") as e:
        preflight(run, world=1)
    assert "\n" not in str(e.value)


YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0)
# Each trained silently against other logits than transformers' (max relative logit error, tiny DeepSeek-V3, 40
# tokens: 6e-3, 3e-2, 0.4); moe_layer_freq failed with a KeyError when the weights loaded.
DISAGREE = [("mscale=0.707 with mscale_all_dim=0", dict(rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0))),
            ("mscale=None with mscale_all_dim=1.0", dict(rope_scaling={k: v for k, v in YARN.items() if k != "mscale"})),
            ("truncate=False", dict(rope_scaling=dict(YARN, truncate=False))),
            ("attention_factor=1.3", dict(rope_scaling=dict(YARN, attention_factor=1.3))),
            ("moe_layer_freq=2", dict(moe_layer_freq=2)),
            # a group of one expert: transformers' topk(2) and Megatron's failed at the first forward, once per rank
            ("n_routed_experts=8 in n_group=8 groups", dict(n_group=8, topk_group=2)),
            ("n_routed_experts=8 in n_group=4 groups with topk_group=None", dict(topk_group=None))]


@pytest.mark.parametrize("field, changes", DISAGREE, ids=[f for f, _ in DISAGREE])
def test_deepseek_fields_transformers_reads_otherwise_are_refused(field, changes):
    with pytest.raises(ModelConfigError, match=f"deepseek_v3 .*{field}") as e:
        map_hf_config(tiny_config("deepseek_v3", **changes))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 1.0), (0.707, 0.707), (1.0, None), (None, None)])
def test_yarn_mscales_all_three_compute_alike_are_mapped(mscale, mscale_all_dim):
    scaling = {k: v for k, v in dict(YARN, mscale=mscale, mscale_all_dim=mscale_all_dim).items() if v is not None}
    map_hf_config(tiny_config("deepseek_v3", rope_scaling=scaling))


# Qwen's long-context recipe (rope_scaling yarn), scaled down; tests/models/test_hf_numerics.py checks its logits.
GQA_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
# Each read otherwise by transformers, Megatron-core or SGLang (mtrain/models/hf_rope.py says how).
GQA_YARN_REFUSED = [
    ("attention_factor=1.3 is not supported", dict(GQA_YARN, attention_factor=1.3)),
    ("attn_factor=2.0 is not supported", dict(GQA_YARN, attn_factor=2.0)),
    ("extrapolation_factor=0.5 is not supported", dict(GQA_YARN, extrapolation_factor=0.5)),
    ("beta_fast=0 is not supported", dict(GQA_YARN, beta_fast=0)),
    ("mscale=0.707 with mscale_all_dim=0 is not supported", dict(GQA_YARN, mscale=0.707, mscale_all_dim=0)),
    ("needs 'factor'", dict(rope_type="yarn", original_max_position_embeddings=64)),
    ("max_position_embeddings=256 is more than .* = 128", dict(GQA_YARN, factor=2.0)),
    ("rope_type='dynamic' is not supported", dict(rope_type="dynamic", factor=2.0)),
    ("partial_rotary_factor=0.5 is not supported", dict(GQA_YARN, partial_rotary_factor=0.5)),
]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "mistral"])
@pytest.mark.parametrize("needle, scaling", GQA_YARN_REFUSED, ids=[n.split(" ")[0] for n, _ in GQA_YARN_REFUSED])
def test_gqa_rope_fields_read_otherwise_are_refused_in_one_line(arch, needle, scaling):
    with pytest.raises(ModelConfigError, match=f"^{arch} .*{needle}") as e:
        map_hf_config(numerics_config(arch, rope_scaling=scaling))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scaling", [dict(GQA_YARN, truncate=False), dict(GQA_YARN, mscale=1.0, mscale_all_dim=0.5),
                                     dict(GQA_YARN, attention_factor=0.1 * math.log(4.0) + 1.0),
                                     dict(GQA_YARN, type="yarn", beta_fast=16, beta_slow=2),
                                     {k: v for k, v in GQA_YARN.items() if k != "original_max_position_embeddings"}],
                         ids=["untruncated", "mscales", "attention_factor_as_computed", "betas", "no_original"])
def test_gqa_yarn_that_all_three_compute_alike_is_mapped(scaling):
    m = map_hf_config(numerics_config("qwen3", rope_scaling=scaling))
    assert m.model_kwargs["position_embedding_type"] == "yarn"
    assert m.config_kwargs["yarn_rotary_scaling_factor"] == 4.0


@pytest.mark.parametrize("changes, needle", [
    (dict(sliding_window=128), "^mistral sliding_window=128 is not supported: mtrain's packed attention computes full "
                               "causal attention"),
    (dict(attention_bias=True), "^mistral attention_bias=True is not supported"),
    # transformers' Mistral windows 4096 tokens when config.json says nothing: refused past that length
    (dict(sliding_window=None, max_position_embeddings=8192), "^mistral config.json has no 'sliding_window': "
                                                               "transformers then uses sliding_window=4096"),
])
def test_mistral_fields_that_would_compute_another_model_are_refused(changes, needle):
    cfg = numerics_config("mistral", **changes)
    if "sliding_window" in changes and changes["sliding_window"] is None:
        del cfg["sliding_window"]
    with pytest.raises(ModelConfigError, match=needle) as e:
        map_hf_config(cfg)
    assert "\n" not in str(e.value)


def test_mistral_window_preflight_is_one_line(tmp_path):
    from pathlib import Path

    from mtrain.config import ConfigError, load_config
    from mtrain.preflight import preflight
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("mistral", tmp_path / "mistral", overrides={"sliding_window": 64})
    config = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    run = load_config(config, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^model\.hf_path: mistral sliding_window=64 is not supported") as e:
        preflight(run, world=1)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- published checkpoints' config.json (hf_real_configs)


@pytest.mark.parametrize("name", sorted(REAL))
def test_published_configs_map_or_are_refused_in_one_line(name):
    """As shipped, and as transformers 5 writes them back (rope_parameters, dtype, layer_types, num_local_experts):
    the same model, or the same one-line refusal. tests/models/test_hf_numerics.py runs the mapped ones' logits."""
    if name in REFUSED:
        for cfg in (REAL[name], transformers5_form(REAL[name])):
            with pytest.raises(ModelConfigError, match="^" + REFUSED[name]) as e:
                map_hf_config(cfg)
            assert "\n" not in str(e.value)
        return
    mapped, written_back = map_hf_config(REAL[name]), map_hf_config(transformers5_form(REAL[name]))
    assert (mapped.config_kwargs, mapped.model_kwargs) == (written_back.config_kwargs, written_back.model_kwargs)


def _qwen3_written_back(**changes) -> dict:
    return dict(transformers5_form(REAL["Qwen3-8B"]), **changes)


# Each loaded and trained against other logits than transformers' and SGLang's (tiny Qwen3-8B, 160 tokens: max
# |logit error| 1.2 and 0.3): transformers takes rope_scaling whole, in place of rope_parameters, and the theta
# inside rope_parameters over a top-level rope_theta.
@pytest.mark.parametrize("cfg, needle", [
    # Qwen's model card block added to a config.json transformers 5 wrote: transformers computes with theta 10000
    (_qwen3_written_back(rope_scaling=QWEN3_YARN), "has both rope_scaling and rope_parameters: transformers and SGLang "
     r"read rope_scaling alone \(rope_theta=10000\) and drop rope_parameters' rope_theta=1000000; put the rope_scaling "
     "keys into rope_parameters"),
    (_qwen3_written_back(rope_theta=5e6), r"states rope_theta=5000000.0 at the top and rope_theta=1000000 in "
     "rope_parameters: transformers and SGLang use rope_parameters'"),
], ids=["rope_scaling_beside_rope_parameters", "rope_theta_beside_rope_parameters"])
def test_rope_fields_stated_twice_are_refused(cfg, needle):
    with pytest.raises(ModelConfigError, match="^qwen3 config.json " + needle) as e:
        map_hf_config(cfg)
    assert "\n" not in str(e.value)


def test_rope_fields_stated_twice_alike_map():
    map_hf_config(_qwen3_written_back(rope_theta=1000000))
    map_hf_config(_qwen3_written_back(rope_scaling=dict(QWEN3_YARN, rope_theta=1000000)))


@pytest.mark.parametrize("arch, changes, needle", [
    ("llama", dict(bias=True), "llama bias=True is not supported: SGLang's Llama then biases q/k/v/o_proj"),
    ("mistral", dict(rope_is_neox_style=False), "mistral rope_is_neox_style=False is not supported"),
])
def test_fields_only_sglang_reads_are_refused(arch, changes, needle):
    with pytest.raises(ModelConfigError, match="^" + needle):
        map_hf_config(numerics_config(arch, **changes))


@pytest.mark.parametrize("name, changes, over, needle", [
    ("gemma-2b", {}, (), r"model\.hf_path: model_type='gemma' is not supported"),
    # SGLang builds every Qwen3-MoE layer sparse: was "engine.tp: engine tp=1 ep=1 does not fit the model: ..."
    ("Qwen3-30B-A3B", dict(mlp_only_layers=[0]), ("engine.kind=sglang",),
     r"model\.hf_path: SGLang 0\.5\.17 makes every Qwen3-MoE layer sparse; this config has dense layers "
     r"\(mlp_only_layers=\[0\], decoder_sparse_step=1\); engine\.kind=reference computes it"),
])
def test_a_published_model_refused_at_preflight_in_one_line(tmp_path, name, changes, over, needle):
    from pathlib import Path

    from mtrain.config import ConfigError, load_config
    from mtrain.preflight import preflight
    from mtrain.tiny_hf import write_tiny_hf
    (tmp_path / "config.json").write_text(json.dumps(dict(shrink(name), **changes)))
    hf = write_tiny_hf(None, tmp_path / "model", config_path=tmp_path / "config.json")
    config = Path(__file__).resolve().parents[2] / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
    run = load_config(config, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", *over])
    with pytest.raises(ConfigError, match="^" + needle) as e:
        preflight(run, world=1)
    assert "\n" not in str(e.value)
