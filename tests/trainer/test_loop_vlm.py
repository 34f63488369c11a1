"""GRPO with images end to end on CPU: a tiny random Qwen2.5-VL (mtrain.tiny_vlm, with its processor), the
count_shapes task, the reference engine running transformers' Qwen2_5_VLForConditionalGeneration, Megatron at PP2 or
TP2 (2 gloo ranks) recomputing logprobs with the images, MRoPE and the frozen (or trained) vision tower, weights synced
into the engine through the planner after every step. Checked: first-step KL 0 and clip fraction 0, engine-vs-trainer
logprob gap <= 1e-5 (float32) in every step, the language model's weights move in the engine while a frozen vision
tower's stay bit-equal to the checkpoint, and a trained one moves; padded and packed (THD) micro-batches."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtrain.dist import run_on_ranks

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "qwen2_5_vl" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from mtrain.tiny_vlm import write_tiny_vlm
    return write_tiny_vlm(tmp_path_factory.mktemp("hf") / "vlm", seed=0)


def _steps(rank, world, hf, run_dir, extra):
    from safetensors.torch import load_file
    from mtrain.config import load_config
    from mtrain.rollout.reference_engine import hf_disk_views
    from mtrain.trainer.loop import Trainer
    overrides = {"model.hf_path": hf, "train.run_dir": run_dir, "train.steps": 2, **extra}
    t = Trainer(load_config(CONFIG, [f"{k}={v}" for k, v in overrides.items()]))
    records = [t.train_step() for _ in range(2)]
    out = {"records": records}
    if rank == 0:
        disk = load_file(str(Path(hf) / "model.safetensors"))
        now = {k: v.detach().clone() for k, v in hf_disk_views(t.engine._model).items()}
        out["vision_same"] = all(torch.equal(now[k], disk[k]) for k in now if k.startswith("visual."))
        out["lm_changed"] = sum(not torch.equal(now[k], disk[k]) for k in now if not k.startswith("visual.")) / \
            sum(1 for k in now if not k.startswith("visual."))
    t.close()
    return out


@pytest.mark.parametrize("train_vision, packed, par", [(False, False, "parallel.pp"), (True, True, "parallel.tp")],
                         ids=["pp2-frozen_vision-padded", "tp2-trained_vision-packed"])
def test_vlm_grpo_kl0_logprobs_match_engine(tiny_vlm, tmp_path, train_vision, packed, par):
    extra = {"model.train_vision": train_vision, par: 2}
    if packed:  # token-budget micro-batches: MRoPE positions and image masks packed along the THD stream
        extra["train.max_tokens_per_micro_batch"] = 300
    res = run_on_ranks(_steps, 2, tiny_vlm, tmp_path / "run", extra, timeout=400)
    lead = res[0]
    first = lead["records"][0]
    # A trained tower runs with autograd in the policy's forward and without it in the frozen reference policy's:
    # torch's attention may take another kernel then (seen: KL 3e-14). A frozen tower gives exactly 0.
    bound = 1e-12 if train_vision else 0.0
    assert abs(first["kl/mean"]) <= bound and abs(first["ppo/approx_kl"]) <= bound, first
    assert first["ppo/clipfrac"] == 0.0
    for step, r in enumerate(lead["records"], 1):
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["grad_norm"] > 0
    assert lead["lm_changed"] > 0.9
    assert lead["vision_same"] is (not train_vision)
