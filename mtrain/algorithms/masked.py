"""Masked reductions and loss aggregation over padded [batch, T] tensors.

Masked positions are selected away with torch.where, never multiplied by 0: padding may hold -inf/NaN
logprobs, and NaN * 0 is NaN.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


class AlgorithmInputError(ValueError):
    """Tensors of the wrong shape or settings that the loss cannot use; the message names them."""


def check_same_shape(mask: Tensor, **tensors: Tensor | None) -> Tensor:
    """Validate [B, T] inputs against the mask; returns the mask as bool."""
    if mask.dim() != 2:
        raise AlgorithmInputError(f"mask must be [batch, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise AlgorithmInputError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}")
    return mask.bool()


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, x.new_zeros(()))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over valid positions; 0 (not NaN) where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased variance over all valid positions (0 with fewer than two)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    ss = masked_sum((x - mean) ** 2, mask)
    return ss / (n - 1).clamp(min=1).to(x.dtype)


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: LossAgg, *, norm_len: int | None = None,
                   num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token_mean               sum over all valid tokens / number of valid tokens (DAPO)
    seq_mean_token_mean      mean over sequences of each sequence's token mean (GRPO paper)
    seq_mean_token_sum       mean over sequences of each sequence's token sum
    seq_mean_token_sum_norm  mean over sequences of token sum / norm_len (Dr. GRPO; norm_len defaults to T,
                             pass max_new_tokens so the normaliser is the same constant in every micro batch)
    With gradient accumulation or data parallelism pass num_tokens / num_seqs, the counts over the whole
    global batch: then the micro-batch losses add up to the global-batch loss instead of a mean of means.
    Sequences without valid tokens are not counted.
    """
    if mode == "token_mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(per_token, mask) / denom
    has_tokens = mask.any(dim=-1)
    seq_denom = has_tokens.sum().clamp(min=1) if num_seqs is None else num_seqs
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
    elif mode == "seq_mean_token_sum":
        per_seq = masked_sum(per_token, mask, dim=-1)
    elif mode == "seq_mean_token_sum_norm":
        per_seq = masked_sum(per_token, mask, dim=-1) / (norm_len or mask.shape[-1])
    else:
        raise AlgorithmInputError(f"unknown loss aggregation {mode!r}; expected one of token_mean, "
                                  f"seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm")
    return masked_sum(per_seq, has_tokens) / seq_denom
