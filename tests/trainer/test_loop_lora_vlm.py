"""LoRA with a trained vision tower (model.lora.targets + model.train_vision=true) on a tiny Qwen2.5-VL, through the
real command line: `torchrun --nproc-per-node 2 -m mtrain train` at TP2, CPU reference engines, float32, 2 steps.

The language model trains adapters; the vision tower and merger train in full. Every sync after the first writes
the tower's rows (a full-weights sync of those rows only) and then the new adapter policy-v{n}. Checked, on every
rank, by the reward (tests/trainer/vision_probe_reward.py) at each engine version: the engine's vision weights equal
the trainer's bit for bit; after step 1 they differ from the checkpoint (trained and synced); the adapter of that
version is active; the tower is trainable and keeps optim.lr while the adapters take model.lora.lr. From the run's
metrics: step 1's engine-vs-trainer logprob gap <= 1e-5 and step 2's too (the engine encodes images with the synced
tower), later syncs carry adapters and vision rows, not the whole base."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loop_harness import REPO, env, train_records

CONFIG = REPO / "examples" / "qwen2_5_vl" / "tiny_cpu.yaml"
PROBE = f"{Path(__file__).resolve().parent / 'vision_probe_reward.py'}:count_shapes_and_probe"


def test_lora_with_trained_vision_torchrun(tmp_path):
    from mtrain.tiny_vlm import write_tiny_vlm
    hf = write_tiny_vlm(tmp_path / "hf", seed=0)
    probe = tmp_path / "probe"
    probe.mkdir()
    overrides = {"model.hf_path": hf, "train.run_dir": tmp_path / "run", "train.steps": 2, "parallel.tp": 2,
                 "model.train_vision": "true", "model.lora.targets": "qkv,o_proj,gate_up,down", "model.lora.rank": 4,
                 "model.lora.alpha": 8, "model.lora.lr": 1e-3, "optim.lr": 1e-4, "reward.fn": PROBE}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "mtrain",
           "train", str(CONFIG), *[f"{k}={v}" for k, v in overrides.items()]]
    p = subprocess.run(cmd, cwd=tmp_path, env=dict(env(), MTRAIN_VISION_PROBE=str(probe)), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    records = train_records(tmp_path / "run")
    assert sorted(records) == [1, 2], sorted(records)
    for step, r in records.items():
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["grad_norm"] > 0, r
        assert r["weight_version"] == step
        # after the first (whole-base) sync: the adapter and the vision rows only
        assert r["sync/adapters_and_vision"] == 1.0 and r["sync/adapters_only"] == 0.0, r
    ranks = sorted(probe.glob("rank*.jsonl"))
    assert ranks, "no rank recorded its engine"
    for f in ranks:
        seen = [json.loads(line) for line in f.read_text().splitlines()]
        assert [s["version"] for s in seen] == [0, 1], (f.name, seen)
        for s in seen:
            assert s["names_equal"] and s["equal_trainer"], (f.name, s)
            assert s["active"] == f"policy-v{s['version']}", (f.name, s)
            # the tower at optim.lr, the adapters at model.lora.lr, nothing else in the optimizer
            assert s["vision_trainable"] and s["numel_by_lr"] == {"0.0001": s["vision_numel"],
                                                                   "0.001": s["adapter_numel"]}, (f.name, s)
        assert seen[0]["changed_vs_disk"] == 0.0, seen[0]
        assert seen[1]["changed_vs_disk"] > 0.5, seen[1]
