"""A config.json field left out means transformers' value for it (its config class's default, or one derived from
the other fields): transformers and SGLang compute with that. Where mtrain would have built another model from the
same file (DeepSeek-V3 without n_group: no expert groups, where transformers routes within 8; Qwen3 without
head_dim: hidden/heads, where transformers takes 128), the field is refused by name, before any work."""
from __future__ import annotations

import json

import pytest

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
    with pytest.raises(ModelConfigError, match=f"no '{key}': transformers then uses {key}={hf_value}") as e:
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
    if name in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"):
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
