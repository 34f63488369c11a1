"""Score centering against float64 code written from the definition (docs/design-score-centering.md):
the full-vocabulary distribution q^ (the sampler's head, the trainer's tail scaled by alpha) built explicitly, the
centered loss -A [w_a log p_a - sum_v sg(q^_v w_v) log p_v] differentiated by autograd, compared with mtrain's
head-only term added to the TIS policy-gradient term."""
from __future__ import annotations

import pytest
import torch

from mtrain.algorithms.masked import aggregate_loss
from mtrain.algorithms.score_centering import centering_coefficients, score_centering_loss

V, K, B, T = 13, 5, 3, 4


def _case(seed: int, k: int = K, shift: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    zq = z + shift * torch.randn(B, T, V, generator=g, dtype=torch.float64)  # the sampler's (mismatched) logits
    lq_full = torch.log_softmax(zq, -1)
    head_ids = lq_full.topk(k, dim=-1).indices
    tokens = torch.multinomial(lq_full.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3] = mask[2, 0] = False
    return z, lq_full, head_ids, tokens, adv, mask


def _f(x, cap):
    return torch.ones_like(x) if cap is None else x.clamp(max=cap)


def _reference_loss(z, lq_full, head_ids, tokens, adv, mask, cap):
    """From the definition, float64, whole vocabulary: token mean over the mask of
    -A [ f(p_a / q_a) log p_a - sum_v sg(q^_v f(p_v / q^_v)) log p_v ]."""
    lp = torch.log_softmax(z, -1)
    p, q = lp.exp(), lq_full.exp()
    in_head = torch.zeros_like(p, dtype=torch.bool).scatter(-1, head_ids, True)
    P_H = (p * in_head).sum(-1, keepdim=True)
    Q_H = (q * in_head).sum(-1, keepdim=True)
    alpha = (1 - Q_H) / (1 - P_H)
    q_hat = torch.where(in_head, q, alpha * p).detach()
    w_all = _f(p.detach() / q_hat, cap)
    mu_term = (q_hat * w_all * lp).sum(-1)
    lp_a = lp.gather(-1, tokens[..., None])[..., 0]
    w_a = _f((lp_a - lq_full.gather(-1, tokens[..., None])[..., 0]).exp(), cap).detach()
    per_token = -adv[:, None] * (w_a * lp_a - mu_term)
    return per_token[mask].sum() / mask.sum()


def _mtrain_loss(z, lq_full, head_ids, tokens, adv, mask, cap):
    """The policy-gradient term as mtrain's objective forms it (REINFORCE form of PPO at ratio 1, the TIS weight
    detached) plus score_centering_loss on the head only."""
    lp = torch.log_softmax(z, -1)
    lp_a = lp.gather(-1, tokens[..., None])[..., 0]
    w_a = _f((lp_a - lq_full.gather(-1, tokens[..., None])[..., 0]).exp(), cap).detach()
    pg = aggregate_loss(-adv[:, None] * w_a * lp_a, mask, "token_mean")
    sc, metrics = score_centering_loss(lp.gather(-1, head_ids), lq_full.gather(-1, head_ids), adv, mask,
                                       loss_agg="token_mean", tis_cap=cap)
    return pg + sc, metrics


@pytest.mark.parametrize("cap", [None, 2.0, 1.05])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_equals_float64_definition(cap, seed):
    z, lq_full, head_ids, tokens, adv, mask = _case(seed)
    z_ref = z.clone().requires_grad_(True)
    _reference_loss(z_ref, lq_full, head_ids, tokens, adv, mask, cap).backward()
    z_mt = z.clone().requires_grad_(True)
    loss, metrics = _mtrain_loss(z_mt, lq_full, head_ids, tokens, adv, mask, cap)
    loss.backward()
    assert torch.allclose(z_mt.grad, z_ref.grad, atol=1e-12, rtol=1e-10), (z_mt.grad - z_ref.grad).abs().max()
    assert float(metrics["score_centering/coef_abs_sum"]) > 1e-3  # the mismatch gives a real correction
    # the correction changes the gradient (else the comparison above would hold trivially)
    z_pg = z.clone().requires_grad_(True)
    lp = torch.log_softmax(z_pg, -1)
    lp_a = lp.gather(-1, tokens[..., None])[..., 0]
    w_a = _f((lp_a - lq_full.gather(-1, tokens[..., None])[..., 0]).exp(), cap).detach()
    aggregate_loss(-adv[:, None] * w_a * lp_a, mask, "token_mean").backward()
    assert (z_pg.grad - z_ref.grad).abs().max() > 1e-3


def test_full_head_is_exact_centering_under_q():
    """K = V: no tail to reconstruct; the correction is sum_v q_v f(p_v/q_v) grad log p_v exactly."""
    z, lq_full, head_ids, tokens, adv, mask = _case(3, k=V)
    zz = z.clone().requires_grad_(True)
    lp = torch.log_softmax(zz, -1)
    sc, _ = score_centering_loss(lp.gather(-1, head_ids), lq_full.gather(-1, head_ids), adv, mask,
                                 loss_agg="token_mean", tis_cap=2.0)
    sc.backward()
    z2 = z.clone().requires_grad_(True)
    lp2 = torch.log_softmax(z2, -1)
    q = lq_full.exp()
    exact = (adv[:, None] * (q * (lp2.detach() - lq_full).exp().clamp(max=2.0) * lp2).sum(-1))[mask].sum() / mask.sum()
    exact.backward()
    assert torch.allclose(zz.grad, z2.grad, atol=1e-10)


@pytest.mark.parametrize("cap", [None, 1.5])
def test_centered_score_has_zero_mean_under_reconstructed_q(cap):
    """E_{a ~ q^}[ grad of the whole per-token loss with A = 1 ] = 0: the drift term is gone (the definition's
    purpose), checked by summing over every possible sampled token a at one prefix."""
    z, lq_full, head_ids, _, _, _ = _case(5)
    z, lq_full, head_ids = z[:1, :1], lq_full[:1, :1], head_ids[:1, :1]
    lp0 = torch.log_softmax(z, -1)
    p, q = lp0.exp(), lq_full.exp()
    in_head = torch.zeros_like(p, dtype=torch.bool).scatter(-1, head_ids, True)
    alpha = (1 - (q * in_head).sum(-1, keepdim=True)) / (1 - (p * in_head).sum(-1, keepdim=True))
    q_hat = torch.where(in_head, q, alpha * p)
    total = torch.zeros(V, dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.bool)
    for a in range(V):
        zz = z.clone().requires_grad_(True)
        lp = torch.log_softmax(zz, -1)
        w_a = _f(p[0, 0, a] / q_hat[0, 0, a], cap)
        sc, _ = score_centering_loss(lp.gather(-1, head_ids), lq_full.gather(-1, head_ids), torch.ones(1,
                                     dtype=torch.float64), one, loss_agg="token_mean", tis_cap=cap)
        (-w_a * lp[0, 0, a] + sc).backward()
        total += q_hat[0, 0, a] * zz.grad[0, 0]
    assert total.abs().max() < 1e-12, total


def test_no_mismatch_no_correction():
    z, _, _, _, adv, mask = _case(7)
    lp = torch.log_softmax(z, -1)
    head = lp.topk(K, -1).indices
    c, _ = centering_coefficients(lp.gather(-1, head), lp.gather(-1, head), tis_cap=None)
    assert c.abs().max() < 1e-12


def test_absent_entries_and_padding_are_inert():
    """A sampler that returned fewer than K entries (-inf) and off-mask positions (garbage) change nothing."""
    z, lq_full, head_ids, tokens, adv, mask = _case(11)
    lp = torch.log_softmax(z, -1)
    h, eh = lp.gather(-1, head_ids), lq_full.gather(-1, head_ids)
    base, _ = score_centering_loss(h[..., :3], eh[..., :3], adv, mask, loss_agg="token_mean")
    eh_pad = eh.clone()
    eh_pad[..., 3:] = -torch.inf
    h_pad = h.clone()
    h_pad[~mask] = float("nan")
    padded, _ = score_centering_loss(h_pad, eh_pad, adv, mask, loss_agg="token_mean")
    assert torch.isfinite(padded) and torch.allclose(base, padded, atol=1e-14)


def test_float32_matches_float64():
    z, lq_full, head_ids, tokens, adv, mask = _case(13)
    grads = []
    for dt in (torch.float64, torch.float32):
        zz = z.to(dt).clone().requires_grad_(True)
        loss, _ = _mtrain_loss(zz, lq_full.to(dt), head_ids, tokens, adv.to(dt), mask, 2.0)
        loss.backward()
        grads.append(zz.grad.double())
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
