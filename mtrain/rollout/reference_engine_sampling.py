"""Sampling of the CPU reference engine: one token and its logprob from a logits row, and the top alternatives.

Kept apart from the decoding loop (reference_engine_decode.py) so that what a token's logprob is lives in one place."""
from __future__ import annotations

import torch

from mtrain.rollout.protocol import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """One token from a float32 [vocab] logits row; returns (token, logprob before top-k/top-p).

    Sampling convention (SGLang's torch path): sort probs descending (stable), zero ranks >= top_k, zero
    tokens whose preceding cumulative prob already exceeds top_p, then inverse-CDF with ONE float64 uniform
    drawn from the request's own generator: the draw count is fixed per step, so results are reproducible
    and independent of batching.
    """
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs, order = torch.sort(logp.exp(), descending=True, stable=True)
    if params.top_k != -1:
        probs[params.top_k:] = 0.0
    if params.top_p < 1.0:
        probs[(torch.cumsum(probs, dim=0) - probs) > params.top_p] = 0.0
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    pos = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs.numel() - 1))
    token = int(order[pos])
    return token, float(logp[token])


def top_alternatives(logits: torch.Tensor, params: SamplingParams) -> list[tuple[int, float]]:
    """The `params.top_logprobs` most likely (token, logprob) of a float32 [vocab] logits row, in the distribution
    `sample_token`'s logprob comes from (log_softmax(logits / T); T = 1 when greedy), most likely first."""
    logp = torch.log_softmax(logits if params.greedy else logits / params.temperature, dim=-1)
    values, ids = torch.topk(logp, params.top_logprobs)
    return [(int(i), float(v)) for i, v in zip(ids, values)]

