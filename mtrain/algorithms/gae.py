"""Generalised advantage estimation (Schulman et al. 2016) over token-level rewards, for PPO with a critic.

Tensors are padded [n, T] with a boolean mask of the tokens the model produced. In multi-turn trajectories the
environment's tokens sit between model turns with mask 0: the recursion skips them, i.e. it runs over the model
tokens of a row only, as if they were contiguous (the next state of the last token of one turn is the first
token of the next model turn), which is how verl's multi-turn GAE treats observation tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_mean, masked_var


def final_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[n, T] token-level rewards: each row's scalar reward on its last masked token, 0 elsewhere
    (a row without model tokens gets none)."""
    mask = check_same_shape(mask)
    if rewards.shape != mask.shape[:1]:
        raise AlgorithmInputError(f"rewards have shape {tuple(rewards.shape)}, expected [{mask.shape[0]}]")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    pos = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(mask, pos, pos.new_full((), -1)).amax(dim=-1)  # -1: no model token
    out = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = rewards.to(dtype)[has]
    return out


def gae_advantages_returns(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float,
                           lam: float) -> tuple[Tensor, Tensor]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t over the model tokens of
    each row (mask-0 tokens skipped, V after the last model token = 0); returns R_t = A_t + V_t.
    Both are 0 on mask-0 tokens. Computed without gradient (values are the critic's detached estimates)."""
    mask = check_same_shape(mask, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise AlgorithmInputError(f"GAE needs 0 <= gamma <= 1 and 0 <= lam <= 1, got gamma={gamma}, lam={lam}")
    with torch.no_grad():
        r = torch.where(mask, token_rewards, token_rewards.new_zeros(()))
        v = torch.where(mask, values.detach(), values.new_zeros(()))
        next_value = v.new_zeros(mask.shape[0])
        running = v.new_zeros(mask.shape[0])
        adv = torch.zeros_like(v)
        for t in reversed(range(mask.shape[1])):
            m = mask[:, t]
            step = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
            # a mask-0 token leaves the recursion's state untouched: the next model token sees through it
            running = torch.where(m, step, running)
            next_value = torch.where(m, v[:, t], next_value)
            adv[:, t] = torch.where(m, step, step.new_zeros(()))
        returns = torch.where(mask, adv + v, v.new_zeros(()))
    return adv, returns


def whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased variance over the masked tokens of the whole batch;
    0 on mask-0 tokens. Call it on the whole rollout batch, not per micro batch."""
    mask = check_same_shape(mask, x=x)
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), x.new_zeros(()))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """1 - Var[R - V] / Var[R] over the masked tokens (unbiased variances, eps in the denominator):
    1 = the critic predicts the returns exactly, 0 = no better than their mean, < 0 = worse."""
    mask = check_same_shape(mask, values=values, returns=returns)
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + eps)
