"""PPO with a critic and on-policy distillation as users run them: `torchrun --nproc-per-node 2 -m mtrain train` on
tiny Llamas (gloo, CPU).

PPO (TP2): metrics appear, the critic's warm-up holds the policy, the critic is checkpointed, and a run stopped at
step 2 and relaunched logs the same metrics (critic's included, exactly) as an uninterrupted one. A frozen-policy
run at DP2 shows the value loss falling. Distillation (TP2): a teacher equal to the student gives a reverse KL of
exactly 0 on the first step (both score the same tokens with the same weights); another teacher scores every model
token of partial-rollout batches (resumed samples' older tokens kept under TIS), its parameters offloaded outside its
forward.
"""
from __future__ import annotations

import math

import pytest

from loop_harness import base_overrides, launch, train_records, without_time

STEPS = 4
PPO = {"algo.name": "ppo", "critic.lr": 1e-3, "critic.warmup_steps": 1, "train.micro_batch_size": 16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("hf")
    return write_tiny_hf("llama", root / "student", seed=0), write_tiny_hf("llama", root / "teacher", seed=1)


@pytest.fixture(scope="module")
def ppo_run(tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo") / "run"
    launch(base_overrides(tiny[0], run, **PPO, **{"train.steps": STEPS, "train.save_interval": 2}), cwd=run.parent)
    return run


def test_ppo_metrics_warmup_and_checkpoint(ppo_run):
    recs = train_records(ppo_run)
    assert sorted(recs) == [1, 2, 3, 4]
    for step, r in recs.items():
        for k in ("critic/value_loss", "critic/explained_var", "critic/vpred_mean", "critic/vf_clipfrac",
                  "critic/grad_norm", "adv/std"):
            assert math.isfinite(r[k]), (step, k)
        assert r["critic/grad_norm"] > 0 and r["critic/lr"] == 1e-3
        # one micro-batch: the first forward of the critic's update sees the weights that scored the rollout
        assert abs(r["critic/vpred_mean"] - r["critic/values_mean"]) < 1e-4
        assert r["ppo/updates"] == (0.0 if step == 1 else 1.0)  # critic.warmup_steps=1
    assert "grad_norm" not in recs[1] and recs[2]["grad_norm"] > 0
    assert recs[1]["critic/values_mean"] != recs[2]["critic/values_mean"]  # the critic moved
    step2 = ppo_run / "checkpoints" / "step_2"
    assert (step2 / "critic").is_dir() and (step2 / "mcore").is_dir()


def test_ppo_resume_restores_the_critic_exactly(ppo_run, tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **PPO, **{"train.steps": 2, "train.save_interval": 2}), cwd=tmp_path)
    launch(base_overrides(tiny[0], run, **PPO, **{"train.steps": STEPS, "train.save_interval": 2}), cwd=tmp_path)
    ref, got = train_records(ppo_run), train_records(run)
    for step in range(1, STEPS + 1):
        assert without_time(got[step]) == without_time(ref[step]), step


def test_ppo_value_loss_falls_dp2(tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.name": "ppo", "critic.lr": 3e-4, "critic.warmup_steps": 6,
                                           "train.steps": 6, "parallel.tp": 1, "train.save_interval": -1}),
           cwd=tmp_path)
    recs = train_records(run)
    loss = [recs[s]["critic/value_loss"] for s in range(1, 7)]
    assert all(recs[s]["ppo/updates"] == 0.0 for s in recs)  # the policy is frozen: the same return distribution
    assert sum(loss[3:]) < 0.5 * sum(loss[:3]), loss


def test_distill_teacher_equal_to_student_gives_zero(tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.distill.teacher_path": tiny[0], "algo.distill.coef": 0.5,
                                           "train.steps": 1, "train.save_interval": -1}), cwd=tmp_path)
    assert train_records(run)[1]["distill/reverse_kl"] == 0.0


def test_distill_partial_rollout_with_offload(tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.distill.teacher_path": tiny[1], "algo.distill.coef": 1.0,
                                           "algo.distill.with_task_advantage": "false", "rollout.partial": "true",
                                           "rollout.offpolicy": "tis", "algo.tis_cap": 2.0,
                                           "engine.offload_train": "true", "train.steps": 3,
                                           "train.save_interval": -1}), cwd=tmp_path)
    recs = train_records(run)
    for step, r in recs.items():
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0.0, step
        assert r["offload/teacher_bytes"] > 0 and r["reload/teacher_bytes"] == r["offload/teacher_bytes"]
        assert r["grad_norm"] > 0
