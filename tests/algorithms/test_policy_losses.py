"""PPO-clip and GSPO losses against float64 Python math (values and gradients) and their edge cases."""
import math

import pytest
import torch

from mtrain.algorithms import AlgorithmInputError, aggregate_loss, gspo_loss, ppo_clip_loss

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def batch(b=6, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3  # ratios well outside the clip range
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[-1] = 0  # one sequence with no response tokens at all
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def ref_ppo(logp, old, adv, mask, lo, hi, dual, mode, norm_len):
    """Loss and d loss / d logp written per token in plain Python."""
    b, t = mask.shape
    per_tok, grad_tok = [[0.0] * t for _ in range(b)], [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            r, a = math.exp(logp[i, j] - old[i, j]), float(adv[i, j])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            loss, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if dual is not None and a < 0 and loss > -a * dual:
                loss, grad = -a * dual, 0.0
            per_tok[i][j], grad_tok[i][j] = loss, grad
    return ref_aggregate(per_tok, grad_tok, mask, mode, norm_len)


def ref_aggregate(per_tok, grad_tok, mask, mode, norm_len):
    b, t = mask.shape
    n_i = [int(mask[i].sum()) for i in range(b)]
    seqs = [i for i in range(b) if n_i[i] > 0]
    weight = [[0.0] * t for _ in range(b)]  # d loss / d per_tok
    for i in seqs:
        for j in range(t):
            if mask[i, j]:
                weight[i][j] = {"token_mean": 1 / sum(n_i), "seq_mean_token_mean": 1 / (len(seqs) * n_i[i]),
                                "seq_mean_token_sum": 1 / len(seqs),
                                "seq_mean_token_sum_norm": 1 / (len(seqs) * norm_len)}[mode]
    loss = sum(weight[i][j] * per_tok[i][j] for i in range(b) for j in range(t))
    grad = torch.tensor([[weight[i][j] * grad_tok[i][j] for j in range(t)] for i in range(b)], dtype=torch.float64)
    return loss, grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lo, hi, dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)])
def test_ppo_clip_loss_value_and_gradient(mode, lo, hi, dual):
    logp, old, adv, mask = batch()
    logp.requires_grad_(True)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, dual_clip_c=dual,
                                  loss_agg=mode, norm_len=12)
    loss.backward()
    exp_loss, exp_grad = ref_ppo(logp.detach(), old, adv, mask, lo, hi, dual, mode, 12)
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp.grad, exp_grad, rtol=1e-10, atol=1e-14)
    assert 0 < metrics["ppo/clipfrac"].item() < 1  # the batch exercises both branches
    assert ("ppo/clipfrac_dual" in metrics) == (dual is not None)


def test_clip_fraction_and_asymmetric_range_on_chosen_ratios():
    # (advantage, ratio): clipped exactly when the flat part of the clip is the max
    cases = [(1.0, 1.5), (1.0, 0.5), (-1.0, 0.5), (-1.0, 1.5), (1.0, 1.25)]
    adv = torch.tensor([[a for a, _ in cases]], dtype=torch.float64)
    old = torch.zeros_like(adv)
    logp = torch.log(torch.tensor([[r for _, r in cases]], dtype=torch.float64))
    mask = torch.ones_like(adv, dtype=torch.bool)
    _, sym = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    _, dapo = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    assert sym["ppo/clipfrac"].item() == pytest.approx(3 / 5)  # 1.5 up, 0.5 down, and 1.25 > 1.2
    assert dapo["ppo/clipfrac"].item() == pytest.approx(2 / 5)  # 1.25 < 1.28 is inside clip-higher's range


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old = torch.log(torch.tensor([[5.0, 2.0]], dtype=torch.float64)), torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = torch.tensor([[-2.0, -2.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = ppo_clip_loss(logp, old, adv, mask, dual_clip_c=3.0, loss_agg="seq_mean_token_sum")
    assert loss.item() == pytest.approx(2.0 * 3.0 + 2.0 * 2.0)  # ratio 5 capped at c=3; ratio 2 below the cap
    assert m["ppo/clipfrac_dual"].item() == pytest.approx(0.5)


def test_first_step_old_equals_new_is_exact():
    logp, _, adv, mask = batch(seed=3)
    logp.requires_grad_(True)
    for fn in (ppo_clip_loss, gspo_loss):
        loss, m = fn(logp, logp.detach().clone(), adv, mask, loss_agg="token_mean")
        assert m["ppo/clipfrac"].item() == 0.0 and m["ppo/approx_kl"].item() == 0.0
        assert m["ppo/ratio_max"].item() == 1.0 and m["ppo/ratio_min"].item() == 1.0
        assert loss.item() == pytest.approx(-(adv[mask]).mean().item(), rel=1e-12)


@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss])
def test_masked_positions_contribute_nothing_even_when_garbage(fn):
    logp, old, adv, mask = batch(seed=5)
    dirty = [x.clone() for x in (logp, old, adv)]
    for x, bad in zip(dirty, (float("-inf"), float("nan"), 1e30)):
        x[~mask] = bad
    clean_lp, dirty_lp = logp.clone().requires_grad_(True), dirty[0].requires_grad_(True)
    l1, m1 = fn(clean_lp, old, adv, mask)
    l2, m2 = fn(dirty_lp, dirty[1], dirty[2], mask)
    l1.backward()
    l2.backward()
    assert l1.item() == l2.item() and torch.isfinite(l2)
    assert torch.equal(clean_lp.grad, dirty_lp.grad) and (dirty_lp.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in m2.values())


def test_all_masked_batch_gives_zero_not_nan():
    z = torch.zeros(2, 3, requires_grad=True)
    for mode in MODES:
        loss, m = ppo_clip_loss(z, z.detach(), z.detach(), torch.zeros(2, 3, dtype=torch.bool), loss_agg=mode)
        assert loss.item() == 0.0 and m["ppo/clipfrac"].item() == 0.0


def test_global_denominators_make_micro_batches_add_up():
    logp, old, adv, mask = batch(b=8, seed=7)
    for mode in MODES:
        full, _ = ppo_clip_loss(logp, old, adv, mask, loss_agg=mode, norm_len=9)
        n_tok, n_seq = mask.sum(), mask.any(-1).sum()
        parts = [ppo_clip_loss(logp[s], old[s], adv[s], mask[s], loss_agg=mode, norm_len=9,
                               num_tokens=n_tok, num_seqs=n_seq)[0] for s in (slice(0, 3), slice(3, 8))]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_gspo_matches_the_sequence_level_objective():
    logp, old, _, mask = batch(seed=11)
    logp = old + (logp - old) * 0.002  # small moves so some sequences stay inside GSPO's tiny clip range
    seq_adv = torch.randn(mask.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lp_a, lp_b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, m = gspo_loss(lp_a, old, seq_adv, mask, clip_eps_low=3e-4, clip_eps_high=4e-4)
    loss.backward()
    # Paper: J = mean_i min(s_i A_i, clip(s_i, 1-lo, 1+hi) A_i), s_i = exp(mean_t (logp - old)), over
    # sequences that have tokens.
    terms = []
    for i in range(mask.shape[0]):
        if mask[i].any():
            s = torch.exp((lp_b[i][mask[i]] - old[i][mask[i]]).mean())
            terms.append(torch.minimum(s * seq_adv[i], s.clamp(1 - 3e-4, 1 + 4e-4) * seq_adv[i]))
    ref = -torch.stack(terms).mean()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-15)
    assert 0 < m["ppo/clipfrac_seq"].item() < 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(clip_eps_low=0.0), "clip range needs 0 < clip_eps_low < 1"),
    (dict(clip_eps_high=-1.0), "clip range needs"),
    (dict(dual_clip_c=1.0), "dual_clip_c must be > 1"),
])
def test_bad_settings(kwargs, message):
    logp, old, adv, mask = batch()
    with pytest.raises(AlgorithmInputError, match=message):
        ppo_clip_loss(logp, old, adv, mask, **kwargs)


def test_bad_shapes_and_modes():
    logp, old, adv, mask = batch()
    with pytest.raises(AlgorithmInputError, match=r"old_logprobs has shape \(6, 8\) but mask has \(6, 9\)"):
        ppo_clip_loss(logp, old[:, :8], adv, mask)
    with pytest.raises(AlgorithmInputError, match=r"mask must be \[batch, T\]"):
        ppo_clip_loss(logp, old, adv, mask[0])
    with pytest.raises(AlgorithmInputError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(logp, mask, "sum")
