"""REINFORCE leave-one-out baseline (RLOO; Ahmadian et al. 2024, "Back to Basics"): an `AdvantageEstimator`.

Each sample's baseline is the mean reward of the *other* samples of its group, so the baseline does not depend on
the sample it corrects (an unbiased estimator, unlike the group mean that includes it):

    A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j        = n / (n - 1) * (r_i - mean_group)

algo.adv_norm=group_std then divides by the group's (unbiased) std + algo.adv_eps, as GRPO does; none leaves it.
A group whose rewards are all equal has no signal: its advantages are exactly 0. Selected by
algo.baseline=leave_one_out (mtrain/trainer/roles.py); config_checks refuses it with PPO's critic, with batch_std
and with groups of one sample.
"""
from __future__ import annotations

import torch

from mtrain.algorithms.advantages import token_advantages


def leave_one_out_advantages(rewards: torch.Tensor, n: int, *, norm: str, eps: float):
    """[B] per-sequence advantages of [B] rewards in groups of n, and the usual adv/ metrics."""
    r = rewards.reshape(-1, n)
    others = (r.sum(dim=-1, keepdim=True) - r) / (n - 1)
    adv = r - others
    if norm == "group_std":
        adv = adv / (r.std(dim=-1, keepdim=True) + eps)
    uniform = (r == r[:, :1]).all(dim=-1, keepdim=True)
    adv = torch.where(uniform, adv.new_zeros(()), adv).reshape(-1)
    a = adv.detach().float()
    metrics = {"adv/mean": a.mean(), "adv/std": a.std() if a.numel() > 1 else a.new_zeros(()),
               "adv/max": a.max(), "adv/min": a.min(), "group/uniform_frac": uniform.float().mean()}
    return adv, metrics


class LeaveOneOutBaseline:
    def __init__(self, algo_cfg, group_size: int):
        self.algo, self.n = algo_cfg, group_size

    def __call__(self, batch, rows: int):
        adv, metrics = leave_one_out_advantages(batch.rewards[:rows], self.n, norm=self.algo.adv_norm,
                                                eps=self.algo.adv_eps)
        return token_advantages(adv, batch.response_mask[:rows].bool()), metrics
