"""Resume at another parallel layout continues the same optimization (issue 19, point 3).

A 4-step run saves after step 2; a copy of that checkpoint is resumed at another layout for steps 3 and 4. Step 4's
KL to the reference and gradient norm depend on the step-3 update, which uses Adam's moments and step count from
the checkpoint, so they match the uninterrupted run only if the optimizer state was resharded correctly (a fresh
Adam's first update is lr * sign(g): far off). Tolerance: float32 reduction order differs between layouts.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest

from loop_harness import CONFIG, env, train_records

KEYS = ("kl/mean", "grad_norm", "loss/total", "reward/mean")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def run(hf, run_dir, nproc: int, *over: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "mtrain", "train", str(CONFIG), f"model.hf_path={hf}", f"train.run_dir={run_dir}", "train.steps=4",
           "train.save_interval=2", "train.eval_interval=0", "train.resume=auto", *over]
    p = subprocess.run(cmd, cwd=run_dir.parent, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-5000:]
    return p


@pytest.mark.parametrize("before, after", [
    ((2, "parallel.tp=2"), (1, "parallel.tp=1")),   # TP2 -> TP1
    pytest.param((2, "parallel.tp=1"), (1, "parallel.tp=1"), marks=pytest.mark.slow),   # DP2 -> DP1 (CI time)
])
def test_resume_at_another_layout_continues_the_same_optimization(tiny_llama, tmp_path, before, after):
    ref = tmp_path / "ref"
    run(tiny_llama, ref, before[0], before[1])
    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "step_2", moved / "checkpoints" / "step_2")
    shutil.copy(ref / "metrics.jsonl", moved / "metrics.jsonl")
    p = run(tiny_llama, moved, after[0], after[1])
    assert "resumed from" in p.stdout and "at step 2" in p.stdout
    assert "checkpoint written at another parallel layout" in p.stdout
    want, got = train_records(ref), train_records(moved)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for k in KEYS:
            assert math.isclose(got[step][k], want[step][k], rel_tol=1e-4, abs_tol=1e-9), (step, k, got[step][k],
                                                                                           want[step][k])
    assert got[4]["kl/mean"] > 0  # the policy moved: the comparison is about a real update


def test_same_layout_format_at_another_layout_is_one_line_saying_what_to_do(tiny_llama, tmp_path):
    """train.optimizer_checkpoint=dp_reshardable (no gather at save) resumes only at its own layout: elsewhere the
    run stops before loading anything, with the two ways forward."""
    ref = tmp_path / "ref"
    run(tiny_llama, ref, 2, "parallel.tp=2", "train.optimizer_checkpoint=dp_reshardable", "train.steps=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "mtrain",
           "train", str(CONFIG), f"model.hf_path={tiny_llama}", f"train.run_dir={ref}", "train.steps=4"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    errors = [x for x in p.stderr.splitlines() if x.startswith("mtrain: error")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert "saved as dp_reshardable at world=2 tp=2" in errors[0] and "cannot be loaded at world=1 tp=1" in errors[0]
    assert f"model.mcore_ckpt={ref / 'checkpoints' / 'step_2' / 'mcore'} in another train.run_dir" in errors[0]


@pytest.mark.slow  # a tiny DeepSeek-V3 run on 2 ranks, then a refused resume
def test_moe_resume_across_an_optimizer_split_is_one_line(tmp_path_factory, tmp_path):
    """EP2 gives the experts an optimizer of their own (2 inner optimizers), one rank builds one: not supported yet,
    said before anything is loaded. (Same-layout MoE resume is exact: the EP2 -> EP2 case resumes normally.)"""
    from loop_harness import SIGNAL_REWARD
    from mtrain.tiny_hf import write_tiny_hf
    ds = write_tiny_hf("deepseek_v3", tmp_path_factory.mktemp("hf") / "deepseek_v3", seed=0)
    ref = tmp_path / "ref"
    run(ds, ref, 2, "parallel.ep=2", f"reward.fn={SIGNAL_REWARD}", "train.steps=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "mtrain",
           "train", str(CONFIG), f"model.hf_path={ds}", f"train.run_dir={ref}", "train.steps=4",
           f"reward.fn={SIGNAL_REWARD}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    errors = [x for x in p.stderr.splitlines() if x.startswith("mtrain: error")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
    assert "saved for 2 optimizer(s) at world=2" in errors[0] and "this run builds 1" in errors[0]
    assert "in another train.run_dir" in errors[0]
