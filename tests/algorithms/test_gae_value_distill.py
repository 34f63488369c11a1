"""GAE, returns, whitening, the clipped value loss and the distillation term against float64 references written
here from the published formulas (plain Python loops over lists), and against verl's core_algos definitions
(its GAE carries the next value and running advantage across masked positions; its whitening and value loss)."""
import math
import random

import pytest
import torch

from mtrain.algorithms.distill import distill_advantages, reverse_kl
from mtrain.algorithms.gae import final_token_rewards, gae, gae_advantages, whiten
from mtrain.algorithms.masked import AlgorithmInputError
from mtrain.algorithms.value_loss import clipped_value_loss, explained_variance

TOL = 1e-12


def _batch(seed, b=5, t=9, multi_turn=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = int(torch.randint(1, t + 1, (1,), generator=g))
        mask[i, :n] = True
        if multi_turn and n > 4:  # an env turn inside the trajectory
            mask[i, 2:4] = False
    mask[-1] = False  # a row with no model token at all
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    rewards = torch.randn(b, generator=g, dtype=torch.float64)
    return rewards, values, mask


def _ref_gae(rewards, values, mask, gamma, lam):
    """Schulman et al. 2016 on the subsequence of model tokens of each row: final-token reward,
    delta_k = r_k + gamma V_{k+1} - V_k (V past the end = 0), A_k = sum_l (gamma lam)^l delta_{k+l}."""
    b, t = mask.shape
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]
        v = [float(values[i, j]) for j in idx]
        r = [0.0] * len(idx)
        if idx:
            r[-1] = float(rewards[i])
        deltas = [r[k] + gamma * (v[k + 1] if k + 1 < len(idx) else 0.0) - v[k] for k in range(len(idx))]
        for k in range(len(idx)):
            a = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
            adv[i][idx[k]] = a
            ret[i][idx[k]] = a + v[k]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _verl_gae(token_rewards, values, mask, gamma, lam):
    """verl core_algos.compute_gae_advantage_return's definition (before its whitening), as a loop."""
    b, t = mask.shape
    m = mask.double()
    nextvalues = torch.zeros(b, dtype=torch.float64)
    lastgaelam = torch.zeros(b, dtype=torch.float64)
    rev = []
    for j in reversed(range(t)):
        delta = token_rewards[:, j] + gamma * nextvalues - values[:, j]
        cand = delta + gamma * lam * lastgaelam
        nextvalues = values[:, j] * m[:, j] + (1 - m[:, j]) * nextvalues
        lastgaelam = cand * m[:, j] + (1 - m[:, j]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return adv, adv + values


def _ref_whiten(x, mask, eps):
    vals = [float(x[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if mask[i, j]:
                out[i, j] = (float(x[i, j]) - mean) / math.sqrt(var + eps)
    return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_published_formula_and_verl(gamma, lam, seed):
    rewards, values, mask = _batch(seed)
    tr = final_token_rewards(rewards, mask)
    adv, ret = gae(tr, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _ref_gae(rewards, values, mask, gamma, lam)
    assert (adv - ref_adv).abs().max() <= TOL and (ret - ref_ret).abs().max() <= TOL
    v_adv, v_ret = _verl_gae(tr, values, mask, gamma, lam)
    # verl leaves its carried values on masked positions; ours are 0 there (by design): compare model tokens
    assert (adv - v_adv)[mask].abs().max() <= TOL and (ret - v_ret)[mask].abs().max() <= TOL
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    rewards, values, mask = _batch(3, multi_turn=False)
    adv, ret = gae(final_token_rewards(rewards, mask), values, mask, gamma=1.0, lam=1.0)
    has = mask.any(dim=-1)
    # every model token's return is the outcome reward (Monte-Carlo return)
    assert (ret - rewards[:, None].expand_as(ret))[mask].abs().max() <= TOL
    assert (adv - (rewards[:, None] - values))[mask].abs().max() <= TOL
    assert has.sum() < mask.shape[0]


def test_env_tokens_do_not_change_the_model_tokens_advantages():
    """An env turn between model tokens: the same result as the trajectory with the env tokens cut out."""
    rewards, values, mask = _batch(4)
    adv, _ = gae(final_token_rewards(rewards, mask), values, mask, gamma=0.9, lam=0.8)
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        m1 = torch.ones(1, len(idx), dtype=torch.bool)
        a1, _ = gae(final_token_rewards(rewards[i:i + 1], m1), values[i:i + 1, idx], m1, gamma=0.9, lam=0.8)
        assert (a1[0] - adv[i, idx]).abs().max() <= TOL


@pytest.mark.parametrize("eps", [1e-8, 1e-6])
def test_whitening_matches_formula_and_verl(eps):
    rewards, values, mask = _batch(5)
    adv, ret, metrics = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95, whitening="batch", eps=eps)
    raw, raw_ret = _ref_gae(rewards, values, mask, 1.0, 0.95)
    assert (adv - _ref_whiten(raw, mask, eps)).abs().max() <= TOL
    assert (ret - raw_ret).abs().max() <= TOL  # returns are never whitened
    # verl masked_whiten: (x - mean) * rsqrt(var * n / (n - 1) + eps) with var the masked mean square
    n = mask.sum().double()
    mean = raw[mask].mean()
    var = ((raw[mask] - mean) ** 2).mean() * n / (n - 1)
    assert (adv[mask] - (raw[mask] - mean) * torch.rsqrt(var + eps)).abs().max() <= TOL
    none, _, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95, whitening="none")
    assert (none - raw).abs().max() <= TOL
    assert abs(float(metrics["adv/mean"])) < 1e-6  # the metric is float32
    kept = whiten(raw, mask, eps=eps, shift_mean=False)
    assert (kept[mask] - (adv[mask] + mean)).abs().max() <= TOL


def _ref_value_loss(v, old, ret, mask, clip):
    per, clipped, n = 0.0, 0, 0
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            if not mask[i, j]:
                continue
            a = (float(v[i, j]) - float(ret[i, j])) ** 2
            vc = min(max(float(v[i, j]), float(old[i, j]) - clip), float(old[i, j]) + clip)
            b = (vc - float(ret[i, j])) ** 2
            per += max(a, b)
            clipped += b > a
            n += 1
    return 0.5 * per / n, clipped / n


@pytest.mark.parametrize("clip", [0.2, 0.5, 10.0])
def test_clipped_value_loss_matches_formula_and_verl(clip):
    g = torch.Generator().manual_seed(7)
    _, old, mask = _batch(7)
    v = old + 0.6 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    ret = torch.randn(old.shape, generator=g, dtype=torch.float64)
    v[~mask] = float("nan")  # padding may hold anything
    loss, m = clipped_value_loss(v, old, ret, mask, clip=clip, loss_agg="token_mean")
    ref, frac = _ref_value_loss(v, old, ret, mask, clip)
    assert abs(float(loss) - ref) <= TOL and abs(float(m["critic/vf_clipfrac"]) - frac) <= TOL
    # verl compute_value_loss: 0.5 * agg(max((vp - R)^2, (clip_by_value(vp, V - c, V + c) - R)^2))
    vz = torch.where(mask, v, 0.0)
    l1, l2 = (vz - ret) ** 2, (torch.max(torch.min(vz, old + clip), old - clip) - ret) ** 2
    verl = 0.5 * torch.where(mask, torch.max(l1, l2), 0.0).sum() / mask.sum()
    assert abs(float(loss) - float(verl)) <= TOL
    if clip == 10.0:
        plain, _ = clipped_value_loss(v, old, ret, mask, clip=None)
        assert abs(float(plain) - float(loss)) <= TOL


def test_value_loss_gradient_and_global_norm():
    _, old, mask = _batch(8)
    ret = torch.zeros_like(old)
    v = (old + 0.1).clone().requires_grad_(True)
    loss, _ = clipped_value_loss(v, old, ret, mask, clip=0.5, num_tokens=float(mask.sum()) * 2)
    loss.backward()
    # inside the clip range: d/dv 0.5 (v - R)^2 / N = (v - R) / N on valid tokens, 0 on padding
    expect = torch.where(mask, (old + 0.1) / (float(mask.sum()) * 2), 0.0)
    assert (v.grad - expect).abs().max() <= TOL


def test_explained_variance():
    _, ret, mask = _batch(9)
    assert abs(float(explained_variance(ret, ret, mask, eps=0.0)) - 1.0) <= TOL
    mean = ret[mask].mean()
    assert abs(float(explained_variance(torch.full_like(ret, float(mean)), ret, mask, eps=0.0))) <= TOL
    vals = [(float(ret[i, j]), 0.3 * float(ret[i, j]) + 0.1) for i in range(ret.shape[0])
            for j in range(ret.shape[1]) if mask[i, j]]

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)
    ref = 1 - var([r - p for r, p in vals]) / var([r for r, _ in vals])
    assert abs(float(explained_variance(0.3 * ret + 0.1, ret, mask, eps=0.0)) - ref) <= TOL


def test_distillation_term():
    g = torch.Generator().manual_seed(11)
    _, _, mask = _batch(11)
    s = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    t = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    s[~mask] = float("-inf")
    task = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    k = reverse_kl(s, t, mask)
    alone, m = distill_advantages(s, t, mask, coef=0.5)
    added, _ = distill_advantages(s, t, mask, coef=0.5, task_advantages=task)
    n, tot = 0, 0.0
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j]:
                kij = float(s[i, j]) - float(t[i, j])
                assert abs(float(k[i, j]) - kij) <= TOL
                assert abs(float(alone[i, j]) + 0.5 * kij) <= TOL
                assert abs(float(added[i, j]) - (float(task[i, j]) - 0.5 * kij)) <= TOL
                tot, n = tot + kij, n + 1
            else:
                assert k[i, j] == 0 and alone[i, j] == 0 and added[i, j] == 0
    assert abs(float(m["distill/reverse_kl"]) - tot / n) <= 1e-6  # the metric is float32


def test_bad_inputs():
    rewards, values, mask = _batch(0)
    with pytest.raises(AlgorithmInputError, match="gamma"):
        gae(values, values, mask, gamma=1.5, lam=1.0)
    with pytest.raises(AlgorithmInputError, match="whitening"):
        gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whitening="group")
    with pytest.raises(AlgorithmInputError, match="clip"):
        clipped_value_loss(values, values, values, mask, clip=0.0)
    with pytest.raises(AlgorithmInputError, match="coef"):
        distill_advantages(values, values, mask, coef=0.0)
    with pytest.raises(AlgorithmInputError, match="shape"):
        gae(values[:, :3], values, mask, gamma=1.0, lam=1.0)
