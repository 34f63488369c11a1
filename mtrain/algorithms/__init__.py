"""Advantages, policy losses (GRPO, Dr. GRPO, DAPO, GSPO, REINFORCE++-baseline) and KL estimators.

Pure torch on padded [batch, T] tensors with a boolean response mask; no Megatron, no engine.
"""
from mtrain.algorithms.advantages import (group_advantages, reinforce_pp_baseline_advantages, token_advantages,
                                          uniform_groups)
from mtrain.algorithms.kl import approx_kl, entropy_from_logits, kl_estimate
from mtrain.algorithms.losses import gspo_loss, ppo_clip_loss, truncated_is_weights
from mtrain.algorithms.masked import (AlgorithmInputError, aggregate_loss, masked_mean, masked_sum,
                                      masked_var)
from mtrain.algorithms.objective import compute_advantages, policy_loss

__all__ = [
    "group_advantages", "reinforce_pp_baseline_advantages", "token_advantages", "uniform_groups",
    "approx_kl", "entropy_from_logits", "kl_estimate", "gspo_loss", "ppo_clip_loss", "truncated_is_weights",
    "AlgorithmInputError", "aggregate_loss", "masked_mean", "masked_sum", "masked_var",
    "compute_advantages", "policy_loss",
]
