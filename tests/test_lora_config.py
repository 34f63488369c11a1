"""model.lora bad input: one ConfigError line naming the key, before anything is built."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.targets=qkv", "model.lora.rank=0"], "model.lora.rank: must be > 0, got 0"),
    (["model.lora.targets=qkv", "model.lora.rank=-4"], "model.lora.rank: must be > 0, got -4"),
    (["model.lora.targets=qkv,attn"], "model.lora.targets: unknown target(s) ['attn']"),
    (["model.lora.targets=qkv,qkv"], "model.lora.targets: names a target twice"),
    (["model.lora.targets=qkv", "model.lora.dropout=1.0"], "model.lora.dropout: must be in [0, 1)"),
    (["model.lora.targets=qkv", "model.lora.lr=0"], "model.lora.lr: must be > 0 or null"),
    (["model.lora.targets=qkv", "model.lora.rank=64", "engine.server_args.max_lora_rank=32"],
     "model.lora.rank: 64 is above the engine's max_lora_rank (32"),
    (["model.lora.targets=qkv", "engine.kind=sglang", "rollout.async=stream", "rollout.max_staleness=2",
      "engine.server_args.max_loras_per_batch=2"],
     "engine.server_args.max_loras_per_batch: 2: rollout.async=stream with max_staleness 2 keeps up to 3"),
    (["model.lora.targets=qkv", "engine.kind=sglang", "engine.server_args.max_loras_per_batch=1"],
     "engine.server_args.max_loras_per_batch: 1: a LoRA sync needs 2 pool slots"),
    (["model.lora.targets=qkv", "engine.kind=sglang", "engine.server_args.enable_lora=true"],
     "engine.server_args: 'enable_lora' is set by model.lora.targets"),
    (["model.lora.targets=qkv", "engine.kind=sglang", "engine.server_args.lora_target_modules=[q_proj]"],
     "engine.server_args: 'lora_target_modules' is set by model.lora.targets"),
])
def test_bad_lora_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["model.hf_path=x", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_lora_defaults_are_full_fine_tuning():
    cfg = load_config(CONFIG, ["model.hf_path=x"])
    assert cfg.model.lora.targets == []
    load_config(CONFIG, ["model.hf_path=x", "model.lora.targets=qkv,o_proj,gate_up,down", "model.lora.rank=32",
                         "engine.server_args.max_lora_rank=32"])


@pytest.mark.parametrize("model_type,overrides,message", [
    ("llama", ["model.lora.targets=experts"], "LoRA target(s) ['experts'] match no layer of this llama model"),
    ("llama", ["model.lora.targets=shared.down"], "match no layer of this llama model"),
    ("qwen3_moe", ["model.lora.targets=experts", "parallel.tp=2"], "experts need expert tensor parallelism 1"),
])
def test_targets_checked_against_the_model(model_type, overrides, message):
    from mtrain.lora_checks import check_model
    from mtrain.tiny_configs import tiny_config
    cfg = load_config(CONFIG, ["model.hf_path=x", *overrides])
    with pytest.raises(ConfigError) as e:
        check_model(cfg, tiny_config(model_type))
    assert str(e.value).startswith("model.lora.targets: ") and message in str(e.value)


def test_vision_language_model_adapters_on_the_language_model_only():
    """Qwen2.5-VL with LoRA (and model.train_vision): accepted; the adapter rows are the language model's, and the
    engine's PEFT config keeps adapters off the vision tower, whose MLP has gate/up/down_proj linears too."""
    from mtrain.layouts import model_layout
    from mtrain.layouts.lora import LoraSpec, lora_layout
    from mtrain.lora_checks import check_model
    from mtrain.tiny_configs import tiny_config
    from mtrain.trainer.publishers.lora import engine_lora_args, vision_layout
    cfg = load_config(CONFIG, ["model.hf_path=x", "model.lora.targets=qkv,gate_up,down", "model.train_vision=true"])
    hf = tiny_config("qwen2_5_vl")
    check_model(cfg, hf)
    base = model_layout(hf)
    spec = LoraSpec(4, 8.0, ("qkv", "gate_up", "down"))
    names = [p.name for w in lora_layout(base, spec).weights for p in w.hf]
    assert names and all(n.startswith("model.layers.") for n in names), names[:4]
    vision = [p.name for w in vision_layout(base).weights for p in w.hf]
    assert vision and all(n.startswith("visual.") for n in vision)
    assert len(vision_layout(base).weights) < len(base.weights)
    args = engine_lora_args(base, spec)
    assert re.fullmatch(args["exclude_modules"], "model.visual.blocks.0.mlp.gate_proj")
    assert not re.fullmatch(args["exclude_modules"], "model.language_model.layers.0.mlp.gate_proj")
    assert "exclude_modules" not in engine_lora_args(model_layout(tiny_config("llama")), spec)


def test_cli_prints_one_line_before_work(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0)
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), f"model.hf_path={hf}",
                        f"train.run_dir={tmp_path / 'run'}", "model.lora.targets=experts"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == ("mtrain: error: ConfigError: model.lora.targets: LoRA target(s) "
                                                 "['experts'] match no layer of this llama model"), p.stderr
    assert not (tmp_path / "run").exists()


def test_sglang_engine_lora_arguments_come_from_model_lora():
    """What make_engine starts SGLang with under model.lora: LoRA on, the run's rank, the adapter table's PEFT names
    (those SGLang normalizes to its qkv_proj / gate_up_proj / o_proj / down_proj pool buffers), two pool slots."""
    from mtrain.tiny_configs import tiny_config
    from mtrain.trainer.engines import sglang_lora_args
    cfg = load_config(CONFIG, ["model.hf_path=x", "engine.kind=sglang", "model.lora.targets=qkv,o_proj,gate_up,down",
                               "model.lora.rank=24"])
    assert sglang_lora_args(cfg, tiny_config("llama")) == {
        "enable_lora": True, "max_lora_rank": 24, "max_loras_per_batch": 2,
        "lora_target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}
    cfg = load_config(CONFIG, ["model.hf_path=x", "engine.kind=sglang", "model.lora.targets=o_proj"])
    assert sglang_lora_args(cfg, tiny_config("llama"))["lora_target_modules"] == ["o_proj"]
    assert sglang_lora_args(load_config(CONFIG, ["model.hf_path=x"]), tiny_config("llama")) == {}
    # stream: a batch keeps the adapter it started on for up to max_staleness syncs, so max_staleness + 1 slots
    cfg = load_config(CONFIG, ["model.hf_path=x", "engine.kind=sglang", "model.lora.targets=o_proj",
                               "rollout.async=stream", "rollout.max_staleness=3"])
    assert sglang_lora_args(cfg, tiny_config("llama"))["max_loras_per_batch"] == 4
