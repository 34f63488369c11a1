"""Advantage estimators (the learner's `AdvantageEstimator` part): one per algorithm family."""
from __future__ import annotations

from mtrain.algorithms.objective import compute_advantages


class GroupBaseline:
    """GRPO family: outcome rewards against their group's baseline (algo.adv_norm: group_std, none, batch_std)."""

    def __init__(self, algo_cfg, group_size: int):
        self.algo, self.n = algo_cfg, group_size

    def __call__(self, batch, rows: int):
        return compute_advantages(self.algo, batch.rewards[:rows], self.n, batch.response_mask[:rows])


class CriticGAE:
    """PPO: generalized advantage estimation with the critic's values (learner/ppo_step.py)."""

    def __init__(self, critic_step):
        self.critic_step = critic_step

    def __call__(self, batch, rows: int):
        return self.critic_step.advantages(batch, rows)


class NoTaskAdvantage:
    """Distillation alone (algo.distill.only): the teacher's per-token term is the whole advantage, so the task reward
    gives none; zeros ([B, T], like the response mask) for the term to replace. No group needed: one sample per prompt
    runs."""

    def __call__(self, batch, rows: int):
        return batch.response_mask[:rows].new_zeros(batch.response_mask[:rows].shape), {}
