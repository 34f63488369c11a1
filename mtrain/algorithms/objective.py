"""The two calls a trainer makes per step, chosen by the run's `algo` config section:

    adv, m1 = compute_advantages(cfg.algo, rewards, group_size, response_mask)   # once per rollout batch
    loss, m2 = policy_loss(cfg.algo, logprobs, old_logprobs, adv, response_mask,  # per micro batch
                           ref_logprobs=..., entropy=..., norm_len=cfg.rollout.max_new_tokens)

`algo` is mtrain.config.AlgoConfig after presets are resolved (load_config does that).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from mtrain.algorithms.advantages import group_advantages, reinforce_pp_baseline_advantages, token_advantages
from mtrain.algorithms.kl import kl_estimate
from mtrain.algorithms.losses import gspo_loss, ppo_clip_loss, truncated_is_weights
from mtrain.algorithms.masked import AlgorithmInputError, aggregate_loss, check_same_shape, masked_mean
from mtrain.algorithms.score_centering import score_centering_loss


def _resolved(algo: Any, *names: str) -> None:
    for n in names:
        if getattr(algo, n) is None:
            raise AlgorithmInputError(f"algo.{n} is unset: resolve presets first (mtrain.config.resolve_presets)")


def compute_advantages(algo: Any, rewards: Tensor, group_size: int, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] advantages (0 on masked tokens) from [B] outcome rewards, per algo.adv_norm:
    group_std / none -> GRPO / Dr. GRPO group baseline; batch_std -> REINFORCE++-baseline."""
    _resolved(algo, "adv_norm")
    mask = check_same_shape(mask)
    if algo.adv_norm == "batch_std":
        return reinforce_pp_baseline_advantages(rewards, group_size, mask, eps=algo.adv_eps)
    adv, metrics = group_advantages(rewards, group_size, norm=algo.adv_norm, eps=algo.adv_eps)
    return token_advantages(adv, mask), metrics


def policy_loss(algo: Any, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                ref_logprobs: Tensor | None = None, entropy: Tensor | None = None,
                rollout_logprobs: Tensor | None = None, norm_len: int | None = None,
                num_tokens: float | Tensor | None = None,
                num_seqs: float | Tensor | None = None, head_logprobs: Tensor | None = None,
                engine_head_logprobs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss (+ kl_coef * KL to the reference, - entropy_coef * entropy), aggregated with
    algo.loss_agg. ref_logprobs is required when kl_coef > 0 (and gives the kl/mean metric otherwise);
    entropy ([B, T], e.g. entropy_from_logits) is required when entropy_coef > 0; rollout_logprobs (the
    engine's) is required when tis_cap is set; head_logprobs / engine_head_logprobs ([B, T, K]: the trainer's
    and the engine's logprobs of the engine's top-k tokens) when algo.score_centering is on.
    Metrics are detached 0-d tensors."""
    _resolved(algo, "clip_eps_low", "clip_eps_high", "kl_coef", "kl_estimator", "loss_agg")
    mask = check_same_shape(mask, ref_logprobs=ref_logprobs, entropy=entropy, rollout_logprobs=rollout_logprobs)
    agg = dict(norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs)
    is_weights = None
    if algo.tis_cap is not None:
        if rollout_logprobs is None:
            raise AlgorithmInputError("algo.tis_cap is set but rollout_logprobs (the engine's) were not given")
        is_weights = truncated_is_weights(old_logprobs, rollout_logprobs, mask, algo.tis_cap)
    common = dict(clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high, loss_agg=algo.loss_agg,
                  is_weights=is_weights, **agg)
    if algo.name == "gspo":
        if algo.dual_clip_c is not None:
            raise AlgorithmInputError("algo.dual_clip_c applies to token-level PPO clipping, not to gspo")
        loss, metrics = gspo_loss(logprobs, old_logprobs, advantages, mask, **common)
    else:
        loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, dual_clip_c=algo.dual_clip_c,
                                      **common)
    if is_weights is not None:
        metrics["tis/weight_mean"] = masked_mean(is_weights, mask).detach()
        # the share of tokens whose engine/trainer ratio the cap truncated: how much of the mismatch TIS cannot
        # correct (the FP8-engine and partial-rollout runs report it beside logprob_diff/*)
        metrics["tis/capped_frac"] = masked_mean((is_weights >= algo.tis_cap).to(is_weights.dtype), mask).detach()
    if getattr(algo, "score_centering", False):
        if head_logprobs is None or engine_head_logprobs is None:
            raise AlgorithmInputError("algo.score_centering is on but the engine's top-k logprobs (and the trainer's "
                                      "of the same tokens) were not given")
        sc, sc_metrics = score_centering_loss(head_logprobs, engine_head_logprobs, advantages, mask,
                                              loss_agg=algo.loss_agg, tis_cap=algo.tis_cap, **agg)
        metrics.update(sc_metrics)
        loss = loss + sc
    if algo.kl_coef > 0 and ref_logprobs is None:
        raise AlgorithmInputError(f"algo.kl_coef={algo.kl_coef} needs ref_logprobs (the reference model's); "
                                  f"set algo.kl_coef=0 to train without a reference model")
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs.detach(), mask, algo.kl_estimator)
        metrics["kl/mean"] = masked_mean(kl, mask).detach()
        if algo.kl_coef > 0:
            kl_loss = aggregate_loss(kl, mask, algo.loss_agg, **agg)
            metrics["loss/kl"] = kl_loss.detach()
            loss = loss + algo.kl_coef * kl_loss
    if algo.entropy_coef > 0 and entropy is None:
        raise AlgorithmInputError(f"algo.entropy_coef={algo.entropy_coef} needs the per-token entropy")
    if entropy is not None:
        metrics["entropy/mean"] = masked_mean(entropy, mask).detach()
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, algo.loss_agg, **agg)
    metrics["loss/total"] = loss.detach()
    return loss, metrics
