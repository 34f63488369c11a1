"""Advantages from outcome rewards with a group baseline (no critic).

Rewards arrive as [B] with the samples of one prompt contiguous: rows [g*G, (g+1)*G) form group g.
A group whose rewards are all equal gets advantage exactly 0 (it carries no learning signal; its mean may
differ from the values by an ulp, so it is zeroed explicitly rather than trusting the subtraction).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_mean, masked_var


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise AlgorithmInputError(f"rewards must be [batch], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise AlgorithmInputError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise AlgorithmInputError(f"rewards has {rewards.numel()} entries, not a positive multiple of "
                                  f"group_size={group_size}")
    if not torch.isfinite(rewards).all():
        raise AlgorithmInputError("rewards contain NaN or inf")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return rewards.to(dtype).view(-1, group_size)


def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[num_groups] bool: True where every reward of the group is equal (DAPO's dynamic sampling drops these)."""
    r = _groups(rewards, group_size)
    return (r == r[:, :1]).all(dim=-1)


def group_advantages(rewards: Tensor, group_size: int, *, norm: str = "group_std",
                     eps: float = 1e-6) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: (r - mean_group) / (std_group + eps) with the unbiased std; norm="none" (Dr. GRPO) skips the
    division. Returns ([B] advantages, metrics)."""
    if norm not in ("group_std", "none"):
        raise AlgorithmInputError(f"group advantage norm must be 'group_std' or 'none', got {norm!r}")
    r = _groups(rewards, group_size)
    centred = r - r.mean(dim=-1, keepdim=True)
    adv = centred / (r.std(dim=-1, keepdim=True) + eps) if norm == "group_std" else centred
    uniform = (r == r[:, :1]).all(dim=-1, keepdim=True)
    adv = torch.where(uniform, adv.new_zeros(()), adv).reshape(-1)
    return adv, _metrics(adv, uniform)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_size: int, mask: Tensor, *,
                                     eps: float = 1e-6) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE++-baseline: subtract the group mean, spread over the response tokens, then whiten over
    all valid tokens of the batch: (x - mean) / sqrt(var + eps). Returns ([B, T] advantages, metrics).
    Whitening uses batch statistics: call it on the whole rollout batch, not per micro batch."""
    r = _groups(rewards, group_size)
    mask = check_same_shape(mask)
    if mask.shape[0] != rewards.numel():
        raise AlgorithmInputError(f"mask has {mask.shape[0]} rows but rewards has {rewards.numel()}")
    uniform = (r == r[:, :1]).all(dim=-1, keepdim=True)
    centred = torch.where(uniform, r.new_zeros(()), r - r.mean(dim=-1, keepdim=True))
    tokens = centred.reshape(-1, 1).expand(mask.shape)
    mean, var = masked_mean(tokens, mask), masked_var(tokens, mask)
    adv = torch.where(mask, (tokens - mean) * torch.rsqrt(var + eps), r.new_zeros(()))
    metrics = _metrics(adv[mask] if mask.any() else adv.new_zeros(1), uniform)
    return adv, metrics


def _metrics(adv: Tensor, uniform: Tensor) -> dict[str, Tensor]:
    a = adv.detach().float()
    return {
        "adv/mean": a.mean(), "adv/std": a.std() if a.numel() > 1 else a.new_zeros(()),
        "adv/max": a.max(), "adv/min": a.min(),
        "group/uniform_frac": uniform.float().mean(),  # fraction of prompts with no learning signal
    }


def token_advantages(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Spread [B] per-sequence advantages over the valid tokens of a [B, T] mask (0 elsewhere)."""
    mask = check_same_shape(mask)
    if seq_adv.shape != mask.shape[:1]:
        raise AlgorithmInputError(f"advantages have shape {tuple(seq_adv.shape)}, expected [{mask.shape[0]}]")
    return torch.where(mask, seq_adv[:, None].expand(mask.shape), seq_adv.new_zeros(()))
