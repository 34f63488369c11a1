"""Score centering (Marek & Ryabinin, arXiv 2609.20807): an additive correction for the sampler/trainer mismatch.

At a prefix h the policy-gradient term of a token is A * w_a * s_a (s_v = grad log p(v | h), w the importance
weight, 1 without TIS). Under the sampler's distribution q its mean is E_q[A] * mu_w + Cov_q(A, w s), with
mu_w = sum_v q_v w_v s_v. mu_w is 0 when q = p (sum_v p_v s_v = 0), not otherwise: the drift that pulls the trainer
towards the sampler. Score centering subtracts it: the per-token gradient becomes A * (w_a s_a - mu_w).

The sampler records only its head H (its top-k tokens, full-vocabulary logprobs, not renormalised over H). The tail
is reconstructed proportionally to the trainer's own tail: q^_v = q_v on H, alpha * p_v off H, with
alpha = (1 - Q_H) / (1 - P_H) (Q_H, P_H: the head masses under q and p). Since sum_v p_v s_v = 0, the tail's share
of mu_w folds onto the head (w off H is f(p / q^) = f(1 / alpha)):

    mu_w = sum_{v in H} c_v s_v,   c_v = q_v f(p_v / q_v) - alpha f(1 / alpha) p_v

so the loss term that has exactly this gradient (coefficients detached, only log p differentiated) is

    l_t = + A_t * sum_{v in H} sg(c_v) log p_v        (added to the policy loss, aggregated like it)

f is the TIS rule of the run: f(x) = min(x, algo.tis_cap), or f = 1 without TIS. The derivation, the sources and
the choices the issue left open: docs/design-score-centering.md. Pure torch on [B, T] / [B, T, K] tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mtrain.algorithms.kl import LOG_RATIO_CLAMP
from mtrain.algorithms.masked import AlgorithmInputError, aggregate_loss, masked_mean, LossAgg

# Below this tail mass (1 - P_H or 1 - Q_H) the head holds the whole distribution for the float32 logprobs it
# is computed from: the tail term is dropped instead of dividing two rounding errors.
TAIL_EPS = 1e-5


def _weight(ratio: Tensor, cap: float | None) -> Tensor:
    """f(p / q): the TIS weight min(ratio, cap), or 1 when the run has no TIS (the policy term is unweighted)."""
    return torch.ones_like(ratio) if cap is None else ratio.clamp(max=cap)


def centering_coefficients(head_logprobs: Tensor, engine_head_logprobs: Tensor, tis_cap: float | None = None
                           ) -> tuple[Tensor, dict[str, Tensor]]:
    """c_v of every head entry, detached. head_logprobs: the trainer's log p of the sampler's head tokens
    [..., K]; engine_head_logprobs: the sampler's log q of the same tokens [..., K], -inf where an entry is absent
    (the sampler returned fewer than K). Returns (c [..., K], per-position tail masses for metrics)."""
    if head_logprobs.shape != engine_head_logprobs.shape:
        raise AlgorithmInputError(f"trainer head logprobs {tuple(head_logprobs.shape)} and engine head logprobs "
                                  f"{tuple(engine_head_logprobs.shape)} differ")
    with torch.no_grad():
        dt = torch.promote_types(head_logprobs.dtype, torch.float32)  # float32 at least; float64 stays float64
        valid = torch.isfinite(engine_head_logprobs)
        lq = torch.where(valid, engine_head_logprobs.to(dt), torch.full((), -torch.inf, dtype=dt))
        lp = torch.where(valid, head_logprobs.detach().to(dt), lq)  # absent entries: -inf on both sides
        # tail masses 1 - P_H and 1 - Q_H as -expm1(logsumexp(head)): no 1 - (sum close to 1) cancellation
        tail_p = (-torch.expm1(torch.logsumexp(lp, dim=-1).clamp(max=0.0))).clamp(min=0.0)
        tail_q = (-torch.expm1(torch.logsumexp(lq, dim=-1).clamp(max=0.0))).clamp(min=0.0)
        q, p = lq.exp(), lp.exp()
        head = q * _weight(torch.exp((lp - lq).clamp(max=LOG_RATIO_CLAMP)), tis_cap)
        head = torch.where(valid, head, torch.zeros((), dtype=head.dtype))
        has_tail = (tail_p > TAIL_EPS) & (tail_q > TAIL_EPS)
        alpha = torch.where(has_tail, tail_q / tail_p.clamp(min=TAIL_EPS), torch.zeros((), dtype=q.dtype))
        # alpha * f(1 / alpha): 1 / alpha is the trainer/sampler ratio of every tail token under q^
        tail_w = torch.where(has_tail, alpha * _weight(1.0 / alpha.clamp(min=1e-30), tis_cap),
                             torch.zeros((), dtype=q.dtype))
        c = head - tail_w.unsqueeze(-1) * torch.where(valid, p, torch.zeros((), dtype=p.dtype))
    return c, {"tail_p": tail_p, "tail_q": tail_q}


def score_centering_loss(head_logprobs: Tensor, engine_head_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                         loss_agg: LossAgg, tis_cap: float | None = None, norm_len: int | None = None,
                         num_tokens: float | Tensor | None = None,
                         num_seqs: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The additive score-centering term (add it to the policy loss). head_logprobs [B, T, K] carries the
    gradient (the trainer's log p of the sampler's head tokens at each predicting position);
    engine_head_logprobs [B, T, K] the sampler's; advantages [B, T] or [B]; mask [B, T]. Aggregated with the
    policy loss's own loss_agg and normalisers, so the two add up token by token."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(mask.shape)
    mask = mask.bool()
    if head_logprobs.dim() != 3 or head_logprobs.shape[:2] != mask.shape:
        raise AlgorithmInputError(f"head logprobs must be [batch, T, K] over the mask {tuple(mask.shape)}, "
                                  f"got {tuple(head_logprobs.shape)}")
    c, tails = centering_coefficients(head_logprobs, engine_head_logprobs, tis_cap)
    c = torch.where(mask.unsqueeze(-1), c, torch.zeros((), dtype=c.dtype))
    # absent head entries and off-mask positions may hold -inf: select them away before the product (0 * -inf)
    lp = torch.where(c != 0, head_logprobs, torch.zeros((), dtype=head_logprobs.dtype))
    adv = torch.where(mask, advantages.detach(), torch.zeros((), dtype=advantages.dtype))
    per_token = adv * (c.to(lp.dtype) * lp).sum(-1)
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len=norm_len, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics = {
            "score_centering/loss": loss.detach(),
            # |mu| proxy: the size of the coefficients the drift term is built from (0 when q = p)
            "score_centering/coef_abs_sum": masked_mean(c.abs().sum(-1), mask),
            "score_centering/tail_mass_engine": masked_mean(tails["tail_q"], mask),
            "score_centering/tail_mass_trainer": masked_mean(tails["tail_p"], mask),
        }
    return loss, metrics
