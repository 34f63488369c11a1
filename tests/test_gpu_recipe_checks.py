"""What an SGLang engine would die of is refused before work starts, in one line naming the key; the keys that
decide the engine's production settings (graphs, graph batch, fp32 head) are read; converted directories carry
what SGLang needs; the GPU recipe refuses a machine without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtrain.config import ConfigError, load_config
from mtrain.converters.hf_config_file import complete_config_file
from mtrain.models.hf_config import ARCHITECTURES
from mtrain.preflight import preflight
from mtrain.rollout.sglang_preflight import default_attention_backend, missing_model_keys, preflight_problems
from mtrain.tiny_hf import write_tiny_hf
from mtrain.trainer.engines import engine_concurrency, production_server_args

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_hf("llama", tmp_path_factory.mktemp("gpu_recipe") / "llama")


def _without_architectures(hf: Path, tmp_path: Path) -> Path:
    out = tmp_path / "noarch"
    out.mkdir()
    for f in hf.iterdir():
        (out / f.name).symlink_to(f)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.pop("architectures")
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _preflight_error(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world=1)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_sglang_engine_refuses_a_directory_without_architectures(hf, tmp_path):
    bare = _without_architectures(hf, tmp_path)
    cfg = load_config(CONFIG, [f"model.hf_path={bare}", "engine.kind=sglang", "model.dtype=bfloat16",
                               f"train.run_dir={tmp_path / 'run'}"])
    msg = _preflight_error(cfg)
    assert msg.startswith("model.hf_path: ") and "'architectures'" in msg
    # the reference engine (HF transformers from config.json) does not need the key
    preflight(load_config(CONFIG, [f"model.hf_path={bare}", "engine.kind=reference",
                                   f"train.run_dir={tmp_path / 'run'}"]), world=1)
    # the engine-level check says the same for callers that start SGLangEngine directly
    (problem,) = missing_model_keys(json.loads((bare / "config.json").read_text()))
    assert "architectures" in problem
    assert missing_model_keys(json.loads((hf / "config.json").read_text())) == []


def test_float32_on_sglang_is_refused_with_what_to_use(hf, tmp_path):
    cfg = load_config(CONFIG, [f"model.hf_path={hf}", "engine.kind=sglang", "model.dtype=float32",
                               f"train.run_dir={tmp_path / 'run'}"])
    msg = _preflight_error(cfg)
    assert msg.startswith("model.dtype: float32") and "bfloat16" in msg
    assert any("float32" in p for p in preflight_problems({"dtype": "float32"}, None, None))
    assert "engine.weight_dtype=bfloat16" in msg
    # a bf16 engine under the float32 trainer is what the message offers: it passes (the engine's dtype is bf16)
    ok = load_config(CONFIG, [f"model.hf_path={hf}", "engine.kind=sglang", "model.dtype=float32",
                              "engine.weight_dtype=bfloat16", f"train.run_dir={tmp_path / 'run'}"])
    assert ok.engine_dtype == "bfloat16" and ok.model.dtype == "float32"
    preflight(ok, world=1)


def test_graph_batch_must_be_positive(hf, tmp_path):
    cfg = load_config(CONFIG, [f"model.hf_path={hf}", "engine.kind=sglang", "model.dtype=bfloat16",
                               "engine.cuda_graph_max_bs=0", f"train.run_dir={tmp_path / 'run'}"])
    assert _preflight_error(cfg).startswith("engine.cuda_graph_max_bs: 0")


def test_production_server_args_follow_the_rollout():
    base = ["model.hf_path=/m", "data.task=arithmetic"]
    cfg = load_config(None, base + ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=8"])
    assert engine_concurrency(cfg) == 64
    assert production_server_args(cfg) == {"attention_backend": default_attention_backend(None),
                                           "disable_cuda_graph": False, "cuda_graph_max_bs_decode": 64}
    # max_groups_in_flight bounds what one engine holds; partial rollout over-samples; rounded up to 8
    cfg = load_config(None, base + ["rollout.prompts_per_step=40", "rollout.samples_per_prompt=3",
                                    "rollout.max_groups_in_flight=16", "train.micro_batch_size=8"])
    assert production_server_args(cfg)["cuda_graph_max_bs_decode"] == 48
    cfg = load_config(None, base + ["rollout.prompts_per_step=5", "rollout.samples_per_prompt=4",
                                    "rollout.partial=true", "rollout.over_sample=1.5"])
    assert engine_concurrency(cfg) == 8 * 4 and production_server_args(cfg)["cuda_graph_max_bs_decode"] == 32
    cfg = load_config(None, base + ["engine.cuda_graph_max_bs=200", "model.fp32_lm_head=true",
                                    "engine.attention_backend=flashinfer"])
    assert production_server_args(cfg) == {"attention_backend": "flashinfer", "disable_cuda_graph": False,
                                           "cuda_graph_max_bs_decode": 200, "enable_fp32_lm_head": True}
    assert default_attention_backend({"common_ops", "flash_ops"}) == "fa3"
    assert default_attention_backend({"common_ops"}) == "triton"


def test_converters_write_architectures(tmp_path):
    for model_type, arch in ARCHITECTURES.items():
        f = tmp_path / f"{model_type}.json"
        f.write_text(json.dumps({"model_type": model_type}))
        complete_config_file(f)
        assert json.loads(f.read_text())["architectures"] == [arch]
    f.write_text(json.dumps({"model_type": "llama", "architectures": ["MyLlama"]}))
    complete_config_file(f)
    assert json.loads(f.read_text())["architectures"] == ["MyLlama"]  # never overwritten


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_gpu_recipe_on_a_cpu_box_is_one_line(tmp_path):
    p = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "run.sh")], cwd=tmp_path,
                       env={**os.environ, "PYTHON": sys.executable, "RECIPE": "gpu"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.sh: error: RECIPE=gpu needs a CUDA GPU and SGLang"), p.stderr
