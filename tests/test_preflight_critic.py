"""Bad PPO input is one line naming the key, before any process group starts: a critic (or a distillation teacher)
that does not fit the layout, algo.name=ppo with group-baseline options, critic keys without PPO. The last case also
through `mtrain train` (exit 2, one line)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.preflight import preflight
from mtrain.tiny_hf import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    return {"policy": write_tiny_hf("llama", root / "policy"),
            "heads": write_tiny_hf("llama", root / "heads", overrides={"num_attention_heads": 3,
                                                                       "num_key_value_heads": 3,
                                                                       "hidden_size": 48})}


def _cfg(models, tmp_path, *overrides):
    return load_config(CONFIG, [f"model.hf_path={models['policy']}", f"train.run_dir={tmp_path / 'run'}", *overrides])


def _one_line(match, fn):
    with pytest.raises(ConfigError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_critic_or_teacher_that_does_not_fit_the_layout(models, tmp_path):
    cfg = _cfg(models, tmp_path, "algo.name=ppo", f"critic.hf_path={models['heads']}", "parallel.tp=2")
    _one_line(r"^critic\.hf_path: .*(tp=2|divisible|split)", lambda: preflight(cfg, world=2))
    cfg = _cfg(models, tmp_path, f"algo.distill.teacher_path={models['heads']}", "parallel.tp=2")
    _one_line(r"^algo\.distill\.teacher_path: ", lambda: preflight(cfg, world=2))
    preflight(_cfg(models, tmp_path, "algo.name=ppo", "parallel.tp=2"), world=2)  # the policy's own: fits


@pytest.mark.parametrize("key", ["critic.hf_path", "algo.distill.teacher_path"])
def test_critic_or_teacher_with_a_damaged_folder(models, tmp_path, key):
    # a config.json without vocab_size was a KeyError traceback from the layout tables; a truncated
    # model.safetensors got past preflight and was a CheckpointError traceback per rank once the model was built
    import json
    import shutil
    bad = Path(shutil.copytree(models["policy"], tmp_path / "side"))
    over = [f"{key}={bad}"] + (["algo.name=ppo"] if key.startswith("critic") else [])
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    _one_line(rf"^{key}: .*model\.safetensors: truncated file", lambda: preflight(_cfg(models, tmp_path, *over)))
    config = json.loads((bad / "config.json").read_text())
    del config["vocab_size"]
    (bad / "config.json").write_text(json.dumps(config))
    if key.startswith("critic"):  # (the teacher's vocab_size is compared with the policy's first, in check_paths)
        _one_line(rf"^{key}: .*missing required field 'vocab_size'", lambda: preflight(_cfg(models, tmp_path, *over)))


@pytest.mark.parametrize("overrides,match", [
    (["algo.name=ppo", "algo.adv_norm=group_std"], r"^algo\.adv_norm: algo\.name=ppo whitens"),
    (["algo.name=ppo", "algo.filter_uniform_groups=true"], r"^algo\.filter_uniform_groups: algo\.name=ppo"),
    (["algo.name=ppo", "parallel.cp=2"], r"^parallel\.cp: the critic"),
    (["algo.name=ppo", "algo.distill.teacher_path=/x", "algo.distill.only=true"], r"^algo\.distill\.only: with algo"),
    (["algo.name=ppo", "critic.value_clip=0"], r"^critic\.value_clip: must be > 0"),
    (["algo.name=ppo", "critic.lam=1.5"], r"^critic\.lam: must be in \[0, 1\]"),
    (["critic.lr=1e-4"], r"^critic\.lr: is set but algo\.name=grpo has no critic"),
])
def test_config_rules(models, tmp_path, overrides, match):
    _one_line(match, lambda: _cfg(models, tmp_path, *overrides))


def test_train_command_says_one_line(models, tmp_path):
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), f"model.hf_path={models['policy']}",
                        f"train.run_dir={tmp_path / 'run'}", "critic.lr=1e-4"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("mtrain: error")]
    assert lines == ["mtrain: error: ConfigError: critic.lr: is set but algo.name=grpo has no critic (critic.* is read by "
                     "algo.name=ppo only)"]
    assert not (tmp_path / "run").exists()
