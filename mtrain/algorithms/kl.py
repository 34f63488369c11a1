"""KL estimators (Schulman, "Approximating KL divergence", 2020), entropy from logits, approx-KL metric.

Samples come from the policy q; with log r = log p_ref(x) - log q(x), KL(q || p_ref) is estimated by
    k1 = -log r                 unbiased, high variance, can be negative
    k2 = (log r)^2 / 2          biased, low variance, >= 0
    k3 = (r - 1) - log r        unbiased, low variance, >= 0 (GRPO's choice)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mtrain.algorithms.masked import AlgorithmInputError, check_same_shape, masked_fill_zero, masked_mean

# exp(20) ~ 5e8: beyond this the estimate is meaningless and exp would overflow in bf16/fp16.
LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference), [B, T], 0 at masked positions."""
    mask = check_same_shape(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = masked_fill_zero(ref_logprobs, mask) - masked_fill_zero(logprobs, mask)
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r.square()
    elif kind == "k3":
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.expm1(log_r) - log_r  # expm1: exact 0 at log_r = 0 and accurate for tiny differences
    else:
        raise AlgorithmInputError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")
    return masked_fill_zero(kl, mask)


def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) averaged over valid tokens: how far one update moved the policy.
    Exactly 0 when logprobs == old_logprobs."""
    return masked_mean(kl_estimate(old_logprobs, logprobs, mask, "k3"), check_same_shape(mask))


def entropy_from_logits(logits: Tensor, chunk_rows: int = 4096) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in float32: [..., V] -> [...].
    Rows are processed in chunks so the float32 copy of a large-vocabulary batch is never whole.
    (With a vocab-parallel lm_head the logits are sharded: use Megatron's vocab-parallel entropy there.)"""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start:start + chunk_rows].float()
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])
