"""PPO with a critic: token-level rewards, GAE (Schulman et al. 2016) and returns, advantage whitening.

All tensors are padded [B, T] with a boolean mask of the tokens the policy generated. Positions where the mask
is 0 (padding, and the environment's tokens inside a multi-turn trajectory) are not steps of the MDP: GAE skips
them, carrying the next model token's value and the running advantage across them, so the recursion runs over
the model tokens only, as if the env tokens were not there (verl's multi-turn GAE does the same). They get
advantage and return 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_mean, masked_var


def final_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B] outcome rewards -> [B, T] token rewards: each row's reward on its last model token, 0 elsewhere
    (a row without model tokens gets nothing)."""
    mask = check_same_shape(mask)
    if rewards.shape != mask.shape[:1]:
        raise AlgorithmInputError(f"rewards have shape {tuple(rewards.shape)}, expected [{mask.shape[0]}]")
    t = mask.shape[1]
    last = torch.where(mask, torch.arange(t, device=mask.device), -1).max(dim=-1).values  # [B], -1: none
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    out = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero().flatten(), last[has]] = rewards.to(dtype)[has]
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the model tokens of each row:
        delta_t = r_t + gamma * V_{t'} - V_t,  A_t = delta_t + gamma * lam * A_{t'}
    where t' is the next model token of the row (V = A = 0 past the last one). Returns (advantages, returns =
    advantages + values), both [B, T] and 0 where the mask is 0. Rewards on masked positions are ignored."""
    mask = check_same_shape(mask, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise AlgorithmInputError(f"GAE needs 0 <= gamma <= 1 and 0 <= lambda <= 1, got {gamma}, {lam}")
    zero = values.new_zeros(())
    r, v = torch.where(mask, token_rewards.to(values.dtype), zero), torch.where(mask, values, zero)
    next_v = values.new_zeros(mask.shape[0])
    running = values.new_zeros(mask.shape[0])
    out = torch.zeros_like(v)
    for t in reversed(range(mask.shape[1])):  # sequential in T, vectorised over the batch
        m = mask[:, t]
        a_t = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * running
        running = torch.where(m, a_t, running)
        next_v = torch.where(m, v[:, t], next_v)
        out[:, t] = torch.where(m, a_t, zero)
    return out, torch.where(mask, out + v, zero)


def whiten(x: Tensor, mask: Tensor, *, eps: float, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens of the whole batch (unbiased variance, as verl's
    masked_whiten); shift_mean=False keeps the mean (scales only). 0 where the mask is 0."""
    mask = check_same_shape(mask, x=x)
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, x.new_zeros(()))


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float,
                   whitening: str = "batch", eps: float = 1e-6) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO's advantages from [B] outcome rewards (on the final model token) and the critic's [B, T] values.
    whitening: "batch" (whiten over every model token of the batch, verl / OpenRLHF's default) or "none".
    Returns (advantages, returns, metrics); whitening is applied to the advantages only, never to the
    returns (the critic's targets). Call it on the whole rollout batch, not per micro batch."""
    if whitening not in ("batch", "none"):
        raise AlgorithmInputError(f"GAE whitening must be 'batch' or 'none', got {whitening!r}")
    mask = check_same_shape(mask, values=values)
    adv, ret = gae(final_token_rewards(rewards, mask).to(values.dtype), values, mask, gamma=gamma, lam=lam)
    if whitening == "batch":
        adv = whiten(adv, mask, eps=eps)
    a = adv.detach().float()
    some = mask.any()
    m = {"adv/mean": masked_mean(a, mask), "adv/std": masked_var(a, mask).sqrt(),
         "adv/max": torch.where(some, a.masked_fill(~mask, float("-inf")).max(), a.new_zeros(())),
         "adv/min": torch.where(some, a.masked_fill(~mask, float("inf")).min(), a.new_zeros(())),
         "critic/returns_mean": masked_mean(ret.detach().float(), mask)}
    return adv, ret, m
