"""Features under engine.placement=separate that once were refused. Learner parts (PPO's critic, on-policy
distillation) live on the training ranks only; the engine rank holds no model (learner/engine_rank.py) and joins the
critic's whole-job collectives (optimizer construction, checkpoint save). Partial rollout is a source: every rank
holds the same buffer (the pool hands every rank every group), the engine rank included. torchrun with 3 gloo ranks
(LoRA: 4, 2 + 2 engine ranks): 2 training ranks (TP2) and 1 engine rank
(reference engine), the tiny model in float32, 2 steps, a checkpoint after step 2. Step 1's engine-vs-trainer
logprob gap is held to 1e-5: the engine generated with exactly the weights the trainer scores with."""
from __future__ import annotations

import pytest

from loop_harness import SIGNAL_REWARD, base_overrides, launch, train_records

SEPARATE3 = {"engine.placement": "separate", "engine.ranks": 1, "parallel.tp": 2, "train.steps": 2,
             "train.save_interval": 2, "reward.fn": SIGNAL_REWARD}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    root = tmp_path_factory.mktemp("hf")
    return write_tiny_hf("llama", root / "student", seed=0), write_tiny_hf("llama", root / "teacher", seed=1)


def _two_steps(hf, run, tmp_path, **extra):
    p = launch(base_overrides(hf, run, **{**SEPARATE3, **extra}), tmp_path, timeout=600, nproc=3)
    assert "placement=separate: training ranks 0-1 (2), engine ranks 2-2 (1: 1 engine(s) of tp 1)" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    assert recs[1]["logprob_diff/max_abs"] <= 1e-5, recs[1]["logprob_diff/max_abs"]
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()
    return recs


def test_ppo_critic_with_separate_engines(models, tmp_path):
    recs = _two_steps(models[0], tmp_path / "run", tmp_path, **{"algo.name": "ppo", "critic.lr": 1e-3,
                                                                 "critic.warmup_steps": 0})
    for s in (1, 2):
        assert recs[s]["ppo/updates"] == 1.0 and recs[s]["critic/grad_norm"] > 0, recs[s]
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "critic").is_dir()


@pytest.mark.slow
def test_distillation_with_separate_engines(models, tmp_path):
    recs = _two_steps(models[0], tmp_path / "run", tmp_path, **{"algo.distill.teacher_path": models[1]})
    for s in (1, 2):
        assert recs[s]["distill/reverse_kl"] > 0.0


def test_partial_rollout_with_separate_engines(models, tmp_path):
    run = tmp_path / "run"
    recs = _two_steps(models[0], run, tmp_path, **{"rollout.partial": "true", "rollout.over_sample": 2})
    for s in (1, 2):
        assert recs[s]["rollout/groups_in_flight"] > 0 and "rollout/buffered_groups" in recs[s]
    assert recs[1]["rollout/offpolicy_token_frac"] == 0.0
    # the buffer is in the checkpoint: a relaunch with more steps resumes it on every rank
    p = launch(base_overrides(models[0], run, **{**SEPARATE3, "rollout.partial": "true", "rollout.over_sample": 2,
                                                 "train.steps": 3}), tmp_path, timeout=600, nproc=3)
    assert "at step 2" in p.stdout and sorted(train_records(run)) == [1, 2, 3]


def test_routing_replay_with_separate_engines(tmp_path):
    """A MoE model (tiny Qwen3-MoE, EP2 over the 2 training ranks): the engine rank's reference engine records every
    token's routed experts, the pool brings them to the training ranks, whose routers replay them."""
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen3_moe", tmp_path / "hf", seed=0)
    recs = _two_steps(hf, tmp_path / "run", tmp_path, **{"parallel.tp": 1, "parallel.ep": 2,
                                                        "algo.routing_replay": "rollout"})
    for s in (1, 2):
        assert recs[s]["routing/bytes_per_token"] == 4 * 2 * 1  # 4 layers x top-2, uint8
        assert 0.0 <= recs[s]["routing/disagreement"] < 0.01, recs[s]


def test_reference_engine_tp2_with_separate_engines(models, tmp_path):
    """engine.tp=2 on the engine ranks: 1 training rank and one engine group of 2 ranks. The reference engine (HF
    layout, one destination rank) receives every piece on the group's leader; the group's second rank receives
    nothing, joins the pool and the job's collectives. The path SGLang at engine.tp=2 shares up to the engine call
    (trainer/publishers/separate.py: the same groups, destination ranks, remote sync and error agreement)."""
    run = tmp_path / "run"
    p = launch(base_overrides(models[0], run, **{**SEPARATE3, "engine.ranks": 2, "engine.tp": 2, "parallel.tp": 1}),
               tmp_path, timeout=600, nproc=3)
    assert "placement=separate: training ranks 0-0 (1), engine ranks 1-2 (2: 1 engine(s) of tp 2)" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    for s, bound in ((1, 1e-5), (2, 2e-5)):  # step 2 samples with the weights step 1 trained and sent
        assert recs[s]["logprob_diff/max_abs"] <= bound, (s, recs[s]["logprob_diff/max_abs"])
        assert recs[s]["sync/bytes"] > 0 and recs[s]["rollout/engines"] == 1.0
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()


def test_lora_with_separate_engines(models, tmp_path):
    """LoRA with 2 training ranks (DP2) and 2 engine ranks (two reference engines): the startup sync sends the base
    and the adapters, every step's sync only the adapters, point to point, which each engine rank loads as the
    version's named adapter. Every step's engine-vs-trainer gap <= 1e-5 (PEFT on HF against Megatron's adapter
    hooks) while the adapters (lr 1e-2) move the policy away from the frozen base: the engines generate with the
    trainer's adapters."""
    run = tmp_path / "run"
    lora = {"model.lora.targets": "qkv,o_proj,gate_up,down", "model.lora.rank": 4, "model.lora.alpha": 8,
            "model.lora.lr": 1e-2}
    p = launch(base_overrides(models[0], run, **{**SEPARATE3, "engine.ranks": 2, "parallel.tp": 1, "train.steps": 3,
                                                 "train.save_interval": 0, **lora}),
               tmp_path, timeout=900, nproc=4)
    assert "engine ranks 2-3 (2: 2 engine(s) of tp 1)" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == [1, 2, 3]
    for s in (1, 2, 3):
        assert recs[s]["logprob_diff/max_abs"] <= 1e-5, (s, recs[s]["logprob_diff/max_abs"])
    # the startup sync sent the base; every step's sync the adapters alone, the same rows each time
    assert all(recs[s]["sync/adapters_only"] == 1.0 for s in (1, 2, 3))
    assert recs[1]["sync/bytes"] == recs[2]["sync/bytes"] == recs[3]["sync/bytes"] > 0
    # the policy the engines sample moved away from the frozen base (the KL reference) by far more than the gap
    assert recs[3]["kl/mean"] > 1e-3, recs[3]["kl/mean"]


@pytest.mark.slow  # a fourth 4-rank run
def test_lora_stream_with_separate_engines(models, tmp_path):
    """LoRA, separate placement and rollout.async=stream together: the engine ranks pause in place, receive the
    adapters point to point and retire the version their paused requests hold; every trained token is within
    max_staleness of its step and nothing is aborted."""
    run = tmp_path / "run"
    lora = {"model.lora.targets": "qkv,o_proj,gate_up,down", "model.lora.rank": 4, "model.lora.alpha": 8,
            "model.lora.lr": 1e-2}
    launch(base_overrides(models[0], run, **{**SEPARATE3, "engine.ranks": 2, "parallel.tp": 1, "train.steps": 3,
                                             "train.save_interval": 0, "rollout.async": "stream",
                                             "rollout.max_new_tokens": 24, **lora}), tmp_path, timeout=900, nproc=4)
    recs = train_records(run)
    assert sorted(recs) == [1, 2, 3]
    for s in (1, 2, 3):
        lags = {int(k.rsplit("_", 1)[1]) for k in recs[s] if k.startswith("rollout/tokens_lag_")}
        assert lags and 0 <= min(lags) and max(lags) <= 1, (s, lags)
        assert recs[s]["rollout/aborted_per_update"] == 0.0 and recs[s]["sync/adapters_only"] == 1.0
