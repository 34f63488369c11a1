"""PPO's clipped value loss for a critic (the value-function clipping of the PPO2 baselines)."""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, LossAgg, aggregate_loss, check_same_shape, masked_mean


def clipped_value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       cliprange_value: float, loss_agg: LossAgg = "token_mean",
                       num_tokens: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * agg( max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) ) over the mask, c = cliprange_value.
    vpreds carry the gradient; old_values (the rollout-time estimates) and returns are targets."""
    mask = check_same_shape(mask, vpreds=vpreds, old_values=old_values, returns=returns)
    if not cliprange_value > 0:
        raise AlgorithmInputError(f"cliprange_value must be > 0, got {cliprange_value}")
    zero = vpreds.new_zeros(())
    v = torch.where(mask, vpreds, zero)
    old = torch.where(mask, old_values.detach(), zero)
    ret = torch.where(mask, returns.detach(), zero)
    # clamp V itself (not old + clamp(V - old)): inside the range that is V exactly, so the clip fraction
    # counts only tokens the clip really moved
    clipped = torch.maximum(torch.minimum(v, old + cliprange_value), old - cliprange_value)
    unclipped_sq, clipped_sq = (v - ret) ** 2, (clipped - ret) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_sq, clipped_sq), mask, loss_agg, num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {"critic/value_loss": loss.detach(),
                   "critic/clipfrac": masked_mean((clipped_sq > unclipped_sq).to(v.dtype), mask),
                   "critic/vpred_mean": masked_mean(v.detach(), mask)}
    return loss, metrics
