"""Policy-gradient losses on padded [B, T] tensors (no critic).

ppo_clip_loss  token-level PPO clip, asymmetric range [1 - eps_low, 1 + eps_high] (DAPO clip-higher) and
               optional dual clip (Ye et al. 2020: bound the loss of negative advantages by c * |A|)
gspo_loss      GSPO: one importance ratio per sequence, exp(mean_t log(pi / pi_old)), clipped per sequence
Each returns (loss, metrics) where metrics are detached 0-d tensors keyed like `ppo/clipfrac`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.kl import LOG_RATIO_CLAMP, approx_kl
from mtrain.algorithms.masked import (AlgorithmInputError, LossAgg, aggregate_loss, check_same_shape,
                                      masked_fill_zero, masked_mean)


def _prepare(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             is_weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if advantages.dim() == 1:  # one advantage per sequence
        advantages = advantages[:, None].expand(mask.shape)
    mask = check_same_shape(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                            is_weights=is_weights)
    # Zero the padding first: -inf/NaN there would poison exp() and its backward even when masked later.
    return (masked_fill_zero(logprobs, mask), masked_fill_zero(old_logprobs.detach(), mask),
            masked_fill_zero(advantages.detach(), mask), mask)


def _clip_objective(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Per-token clipped loss max(-A r, -A clip(r)) and where the clipped branch is the active one."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (0.0 < eps_low < 1.0 and eps_high > 0.0):
        raise AlgorithmInputError(f"clip range needs 0 < clip_eps_low < 1 and clip_eps_high > 0, "
                                  f"got {eps_low}, {eps_high}")


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                  clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip_c: float | None = None,
                  loss_agg: LossAgg = "token_mean", is_weights: Tensor | None = None,
                  norm_len: int | None = None, num_tokens: float | Tensor | None = None,
                  num_seqs: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy loss. advantages: [B, T] or [B]. is_weights: optional per-token weights (detached),
    e.g. truncated importance sampling between the rollout engine and the trainer."""
    _check_eps(clip_eps_low, clip_eps_high)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise AlgorithmInputError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, mask, is_weights)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    per_token, clipped = _clip_objective(ratio, adv, clip_eps_low, clip_eps_high)
    metrics: dict[str, Tensor] = {}
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c  # for A < 0 the loss -A r grows without limit in r: cap it at c |A|
        dual_active = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        metrics["ppo/clipfrac_dual"] = masked_mean(dual_active.float(), mask).detach()
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, clipped, mask, logp, old))
        metrics["ppo/pg_loss"] = loss.detach()
    return loss, metrics


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4, loss_agg: LossAgg = "seq_mean_token_mean",
              is_weights: Tensor | None = None, norm_len: int | None = None,
              num_tokens: float | Tensor | None = None,
              num_seqs: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), in its token form: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] has the value of
    the sequence ratio s_i = exp(mean_t log(pi/pi_old)) and its gradient, so with seq_mean_token_mean
    (the default) loss and gradient equal the paper's sequence-level objective, while per-token
    advantages (and other aggregations) still work."""
    _check_eps(clip_eps_low, clip_eps_high)
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, mask, is_weights)
    seq_log_ratio = masked_mean(logp - old, mask, dim=-1)[:, None]  # [B, 1]
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_CLAMP))
    per_token, clipped = _clip_objective(ratio, adv, clip_eps_low, clip_eps_high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = _ratio_metrics(ratio, clipped, mask, logp, old)
        has = mask.any(dim=-1)
        seq_clipped = (clipped & mask).any(dim=-1).float()
        metrics["ppo/clipfrac_seq"] = masked_mean(seq_clipped, has)
        metrics["ppo/pg_loss"] = loss.detach()
    return loss, metrics


def _ratio_metrics(ratio: Tensor, clipped: Tensor, mask: Tensor, logp: Tensor, old: Tensor) -> dict[str, Tensor]:
    # Masked reductions and torch.where instead of ratio[mask] / `if mask.any()`: those read the device (a host
    # sync in every micro-batch's loss on a GPU). No valid position: all three are 1.
    some = mask.any()
    one = ratio.new_ones(())
    return {
        "ppo/clipfrac": masked_mean(clipped.float(), mask),
        "ppo/approx_kl": approx_kl(logp.detach(), old, mask),
        "ppo/ratio_mean": torch.where(some, masked_mean(ratio, mask), one),
        "ppo/ratio_max": torch.where(some, ratio.masked_fill(~mask, float("-inf")).max(), one),
        "ppo/ratio_min": torch.where(some, ratio.masked_fill(~mask, float("inf")).min(), one),
    }


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS): min(pi_old_trainer / pi_rollout_engine, cap) per token, detached.
    Corrects for the engine sampling from a slightly different distribution than the trainer computes."""
    if cap <= 0:
        raise AlgorithmInputError(f"TIS cap must be > 0, got {cap}")
    mask = check_same_shape(mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    log_w = masked_fill_zero(old_logprobs.detach(), mask) - masked_fill_zero(rollout_logprobs.detach(), mask)
    return masked_fill_zero(torch.exp(log_w.clamp(max=LOG_RATIO_CLAMP)).clamp(max=cap), mask)
