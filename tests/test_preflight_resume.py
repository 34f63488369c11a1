"""The checkpoint a run resumes from holds the configured model and adapters (mtrain/preflight_resume.py).

A run dir trained with one model (or with LoRA) and started again with another model (or without LoRA) built
every model, then died in megatron-core's loader with a traceback per rank; now it is one line before any process
group. The checkpoint is a real conversion of a tiny model with the files a save writes beside it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.config import ConfigError, load_config
from mtrain.preflight import preflight
from mtrain.tiny_hf import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume_models")
    return {"llama": write_tiny_hf("llama", root / "llama"),
            "wide": write_tiny_hf("llama", root / "wide", overrides={"hidden_size": 128}),
            "qwen3": write_tiny_hf("qwen3", root / "qwen3")}


@pytest.fixture(scope="module")
def step_2(models, tmp_path_factory) -> Path:
    """A complete checkpoint of the tiny llama, as checkpoint.save leaves it."""
    from mtrain.converters.hf_to_mcore import hf_to_mcore
    step = tmp_path_factory.mktemp("resume_ckpt") / "step_2"
    hf_to_mcore(models["llama"], step / "mcore")
    torch.save({"step": 2}, step / "trainer_state.pt")
    torch.save({}, step / "rng_rank0.pt")
    (step / "COMPLETE").write_text("2")
    return step


def run_dir(tmp_path: Path, step_2: Path, lora: bool = False) -> Path:
    run = tmp_path / "run"
    shutil.copytree(step_2, run / "checkpoints" / "step_2")
    if lora:
        from mtrain.layouts.lora import LoraSpec, write_meta
        write_meta(run / "checkpoints" / "step_2" / "mcore", LoraSpec(8, 16.0, ("qkv", "o_proj")))
    return run


def cfg(hf: Path, run: Path, *overrides: str):
    return load_config(CONFIG, [f"model.hf_path={hf}", f"train.run_dir={run}", "train.steps=6", *overrides])


def test_the_same_model_resumes(models, step_2, tmp_path):
    preflight(cfg(models["llama"], run_dir(tmp_path, step_2)), world=1)


@pytest.mark.parametrize("model, why", [("wide", "hidden size 64, the model's is 128"),
                                        ("qwen3", "it has no decoder.layers.self_attention.k_layernorm.weight")])
def test_a_run_dir_of_another_model_is_one_line_at_every_world_size(models, step_2, tmp_path, model, why):
    run = run_dir(tmp_path, step_2)
    messages = set()
    for world in (1, 2):
        with pytest.raises(ConfigError) as e:
            preflight(cfg(models[model], run), world=world)
        messages.add(str(e.value))
    (message,) = messages
    assert message.startswith(f"train.resume: {run / 'checkpoints' / 'step_2'} holds another model") and why in message
    assert "pick another train.run_dir" in message and "\n" not in message
    with pytest.raises(ConfigError, match="or set train.resume to a checkpoint of this model"):  # an explicit path
        preflight(cfg(models[model], tmp_path / "other", f"train.resume={run / 'checkpoints' / 'step_2'}"), world=1)
    preflight(cfg(models[model], run, "train.resume=never"), world=1)  # starting over is not refused here


def test_lora_adapters_must_match_model_lora(models, step_2, tmp_path):
    run = run_dir(tmp_path, step_2, lora=True)
    with pytest.raises(ConfigError, match=r"holds LoRA adapters of rank 8 on qkv, o_proj, this run asks for no LoRA "
                                          r"adapters \(full fine-tuning\): resume it with model.lora.targets="
                                          r"\[qkv,o_proj\] model.lora.rank=8, or pick another train.run_dir"):
        preflight(cfg(models["llama"], run), world=1)
    with pytest.raises(ConfigError, match="this run asks for LoRA adapters of rank 16 on o_proj, qkv: "):
        preflight(cfg(models["llama"], run, "model.lora.targets=[o_proj,qkv]"), world=1)
    preflight(cfg(models["llama"], run, "model.lora.targets=[o_proj,qkv]", "model.lora.rank=8"), world=1)
    plain = run_dir(tmp_path / "plain", step_2)
    with pytest.raises(ConfigError, match=r"holds no LoRA adapters .*: resume it with model.lora.targets=\[\]"):
        preflight(cfg(models["llama"], plain, "model.lora.targets=[qkv]"), world=1)


def test_the_user_sees_one_line_and_exit_2(models, step_2, tmp_path):
    run = run_dir(tmp_path, step_2)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", "--nproc-per-node", "2", str(CONFIG),
                        f"model.hf_path={models['wide']}", f"train.run_dir={run}", "train.steps=6"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines()[-1].startswith("mtrain: error: ConfigError: train.resume: ")
    assert sorted(os.listdir(run)) == ["checkpoints"]  # nothing written
