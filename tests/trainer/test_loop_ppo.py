"""PPO with a critic as users run it: `torchrun --nproc-per-node 2 -m mtrain train` on a tiny Llama (gloo, CPU).

TP2: metrics appear, the critic's warm-up holds the policy, the critic is checkpointed, and a run stopped at step 2
and relaunched logs the same metrics (the critic's included, exactly) as an uninterrupted one. A frozen-policy run at
DP2 shows the value loss falling. With a teacher (algo.distill) the critic's advantages get the distillation term,
and with engine.offload_train the critic's gradients and Adam state move like the policy's.
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
    return write_tiny_hf("llama", root / "policy", seed=0), write_tiny_hf("llama", root / "teacher", seed=1)


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


@pytest.mark.slow  # ~20 s
def test_ppo_value_loss_falls_dp2(tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.name": "ppo", "critic.lr": 3e-4, "critic.warmup_steps": 6,
                                           "train.steps": 6, "parallel.tp": 1, "train.save_interval": -1}),
           cwd=tmp_path)
    recs = train_records(run)
    loss = [recs[s]["critic/value_loss"] for s in range(1, 7)]
    assert all(recs[s]["ppo/updates"] == 0.0 for s in recs)  # the policy is frozen: the same return distribution
    assert sum(loss[3:]) < 0.5 * sum(loss[:3]), loss



@pytest.mark.slow  # ~20 s
def test_ppo_with_distillation_and_offload(tiny, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.name": "ppo", "critic.lr": 1e-3, "algo.distill.teacher_path": tiny[1],
                                           "engine.offload_train": "true", "train.steps": 2,
                                           "train.save_interval": -1}), cwd=tmp_path)
    for step, r in train_records(run).items():
        assert r["distill/reverse_kl"] != 0.0 and math.isfinite(r["critic/value_loss"]), step
        # reloaded: the gradient buffers (and Adam's state after step 1); offloaded after the update: both
        assert 0 < r["critic/reload/bytes"] <= r["critic/offload/bytes"], step
        assert r["grad_norm"] > 0 and r["critic/grad_norm"] > 0


@pytest.mark.slow  # ~25 s
def test_ppo_pp2_two_minibatches_scores_as_tp2(ppo_run, tiny, tmp_path):
    """PP2, two PPO minibatches per rollout: the critic's first values (before any update) of the same rollouts are
    those of the TP2 run, and both minibatches update policy and critic."""
    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{**PPO, "critic.warmup_steps": 0, "train.micro_batch_size": 4,
                                           "parallel.tp": 1, "parallel.pp": 2, "train.global_batch_size": 8,
                                           "train.steps": 1, "train.save_interval": -1}), cwd=tmp_path)
    got, ref = train_records(run)[1], train_records(ppo_run)[1]
    for k in ("critic/values_mean", "critic/explained_var", "critic/returns_mean", "reward/mean"):
        assert abs(got[k] - ref[k]) < 1e-5, (k, got[k], ref[k])
    assert got["ppo/updates"] == 2.0 and got["critic/grad_norm"] > 0


def test_ppo_takes_one_sample_per_prompt(tiny, tmp_path):
    """PPO's advantage is its critic's GAE, not a group baseline: rollout.samples_per_prompt=1 (the classic PPO
    batch) was refused at load with the GRPO family's reason. 2 steps at TP2: the advantages are not all 0 and the
    policy's gradient is not 0; GRPO keeps the refusal."""
    from mtrain.config import ConfigError, load_config
    from loop_harness import CONFIG

    run = tmp_path / "run"
    launch(base_overrides(tiny[0], run, **{"algo.name": "ppo", "critic.lr": 1e-3, "rollout.samples_per_prompt": 1,
                                           "rollout.prompts_per_step": 4, "train.micro_batch_size": 2,
                                           "train.steps": 2, "train.save_interval": -1}), cwd=tmp_path)
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    for r in recs.values():
        assert r["adv/std"] > 0.5 and r["grad_norm"] > 0.0, r
        assert r["logprob_diff/max_abs"] <= 1e-5
    with pytest.raises(ConfigError, match="rollout.samples_per_prompt: must be >= 2 for grpo"):
        load_config(CONFIG, ["model.hf_path=x", "rollout.samples_per_prompt=1"])
