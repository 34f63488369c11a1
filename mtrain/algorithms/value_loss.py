"""The critic's loss: PPO's clipped value loss (as in verl / OpenAI baselines) and explained variance."""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import (AlgorithmInputError, LossAgg, aggregate_loss, check_same_shape,
                                      masked_fill_zero, masked_mean, masked_var)


def clipped_value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       clip: float | None, loss_agg: LossAgg = "token_mean", norm_len: int | None = None,
                       num_tokens: float | Tensor | None = None,
                       num_seqs: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)): the new prediction may not profit
    from moving further than c from the value the rollout was scored with. clip=None: plain 0.5 * (V - R)^2.
    Returns (loss, metrics) with critic/vf_clipfrac (share of tokens where the clipped branch is larger)."""
    mask = check_same_shape(mask, vpreds=vpreds, old_values=old_values, returns=returns)
    if clip is not None and clip <= 0:
        raise AlgorithmInputError(f"value clip range must be > 0 (or unset), got {clip}")
    v = masked_fill_zero(vpreds, mask)
    ret = masked_fill_zero(returns.detach(), mask)
    loss1 = (v - ret).square()
    if clip is None:
        per_token, clipped = loss1, torch.zeros_like(mask)
    else:
        old = masked_fill_zero(old_values.detach(), mask)
        loss2 = (torch.clamp(v, old - clip, old + clip) - ret).square()
        per_token, clipped = torch.maximum(loss1, loss2), loss2 > loss1
    loss = 0.5 * aggregate_loss(per_token, mask, loss_agg, norm_len=norm_len, num_tokens=num_tokens,
                                num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {"critic/value_loss": loss.detach(), "critic/vf_clipfrac": masked_mean(clipped.to(v.dtype), mask),
                   "critic/vpred_mean": masked_mean(v.detach().float(), mask)}
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """1 - Var[R - V] / Var[R] over the valid tokens (unbiased variances): 1 = the critic predicts the returns,
    0 = no better than their mean, < 0 = worse."""
    mask = check_same_shape(mask, values=values, returns=returns)
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + eps)
