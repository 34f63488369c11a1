"""GAE, returns, whitening, explained variance, the clipped value loss and the distillation term against float64
Python loops written here from the published formulas (Schulman et al. 2016 for GAE; PPO2's value clipping)."""
import math

import pytest
import torch

from mtrain.algorithms.distill import distill_advantages, reverse_kl_per_token
from mtrain.algorithms.gae import explained_variance, final_token_rewards, gae_advantages_returns, whiten
from mtrain.algorithms.masked import AlgorithmInputError


def ragged_mask(n, t, seed):
    """Rows of different lengths with mask-0 gaps inside (environment turns), one row with no model token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n - 1):
        length = int(torch.randint(1, t + 1, (1,), generator=g))
        mask[i, :length] = True
        if length > 3:  # an environment turn in the middle
            a = int(torch.randint(1, length - 1, (1,), generator=g))
            mask[i, a:a + int(torch.randint(1, 3, (1,), generator=g))] = False
    mask[0, :] = True
    mask[0, 2:4] = False
    return mask


def ref_gae(rewards, values, mask, gamma, lam):
    """Per row: the list of model-token positions, then A_k = delta_k + gamma*lam*A_{k+1} backwards over it."""
    n, t = len(mask), len(mask[0])
    adv = [[0.0] * t for _ in range(n)]
    ret = [[0.0] * t for _ in range(n)]
    for i in range(n):
        pos = [j for j in range(t) if mask[i][j]]
        running, next_v = 0.0, 0.0
        for j in reversed(pos):
            delta = rewards[i][j] + gamma * next_v - values[i][j]
            running = delta + gamma * lam * running
            adv[i][j] = running
            ret[i][j] = running + values[i][j]
            next_v = values[i][j]
    return adv, ret


def ref_masked_stats(x, mask):
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if mask[i][j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, var


@pytest.mark.parametrize("gamma,lam,seed", [(1.0, 1.0, 0), (1.0, 0.95, 1), (0.99, 0.9, 2), (0.9, 0.0, 3)])
def test_gae_and_returns_match_reference(gamma, lam, seed):
    torch.manual_seed(seed)
    n, t = 7, 11
    mask = ragged_mask(n, t, seed)
    values = torch.randn(n, t, dtype=torch.float64)
    rewards = torch.randn(n, dtype=torch.float64)
    tok = final_token_rewards(rewards, mask)
    # final-token placement against a loop
    for i in range(n):
        pos = [j for j in range(t) if mask[i, j]]
        for j in range(t):
            want = rewards[i].item() if pos and j == pos[-1] else 0.0
            assert tok[i, j].item() == want
    dense = torch.randn(n, t, dtype=torch.float64)  # dense token rewards exercise every delta
    for r in (tok, dense):
        adv, ret = gae_advantages_returns(r, values, mask, gamma=gamma, lam=lam)
        want_adv, want_ret = ref_gae(r.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_with_lambda_one_gamma_one_is_reward_to_go_minus_value():
    # Monte-Carlo special case: A_t = sum of later rewards - V_t, whatever the gaps
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, -1.0, 9.0, 9.0, 2.0, 0.25, 9.0]], dtype=torch.float64)
    tok = final_token_rewards(torch.tensor([3.0], dtype=torch.float64), mask)
    adv, ret = gae_advantages_returns(tok, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == [2.5, 4.0, 0.0, 0.0, 1.0, 2.75, 0.0]
    assert ret[0].tolist() == [3.0, 3.0, 0.0, 0.0, 3.0, 3.0, 0.0]


def test_whiten_and_explained_variance_match_reference():
    torch.manual_seed(5)
    n, t = 6, 9
    mask = ragged_mask(n, t, 5)
    x = torch.randn(n, t, dtype=torch.float64) * 3 + 1
    mean, var = ref_masked_stats(x.tolist(), mask.tolist())
    w = whiten(x, mask, eps=1e-8)
    for i in range(n):
        for j in range(t):
            want = (x[i, j].item() - mean) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0
            assert abs(w[i, j].item() - want) <= 1e-12
    values = torch.randn(n, t, dtype=torch.float64)
    ret = values + 0.3 * torch.randn(n, t, dtype=torch.float64)
    _, var_r = ref_masked_stats(ret.tolist(), mask.tolist())
    _, var_d = ref_masked_stats((ret - values).tolist(), mask.tolist())
    ev = explained_variance(values, ret, mask, eps=1e-8)
    assert abs(ev.item() - (1 - var_d / (var_r + 1e-8))) <= 1e-12
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("clip", [0.2, 0.5, 10.0])
def test_clipped_value_loss_matches_reference(clip):
    torch.manual_seed(7)
    n, t = 6, 10
    mask = ragged_mask(n, t, 7)
    vpreds = torch.randn(n, t, dtype=torch.float64, requires_grad=True)
    old = vpreds.detach() + 0.4 * torch.randn(n, t, dtype=torch.float64)
    ret = torch.randn(n, t, dtype=torch.float64)
    loss, m = clipped_value_loss_call(vpreds, old, ret, mask, clip)
    total, count, clipped_count = 0.0, 0, 0
    for i in range(n):
        for j in range(t):
            if not mask[i, j]:
                continue
            v, o, r = vpreds[i, j].item(), old[i, j].item(), ret[i, j].item()
            vc = min(max(v, o - clip), o + clip)
            a, b = (v - r) ** 2, (vc - r) ** 2
            total += max(a, b)
            clipped_count += b > a
            count += 1
    assert abs(loss.item() - 0.5 * total / count) <= 1e-12
    assert abs(m["critic/clipfrac"].item() - clipped_count / count) <= 1e-12
    loss.backward()
    assert (vpreds.grad[~mask] == 0).all() and torch.isfinite(vpreds.grad).all()


def clipped_value_loss_call(vpreds, old, ret, mask, clip):
    from mtrain.algorithms.value_loss import clipped_value_loss
    return clipped_value_loss(vpreds, old, ret, mask, cliprange_value=clip)


def test_value_loss_gradient_matches_reference():
    from mtrain.algorithms.value_loss import clipped_value_loss
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    v = torch.tensor([[1.0, 0.0, 5.0, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    ret = torch.tensor([[3.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _ = clipped_value_loss(v, old, ret, mask, cliprange_value=0.5)
    loss.backward()
    # token 0: unclipped (1-3)^2=4, clipped (0.5-3)^2=6.25 -> clipped branch, constant in v: grad 0
    # token 1: both (0+1)^2 = 1, the max takes the first (unclipped): grad 0.5*2*(0+1)/3
    # token 3: unclipped 4 vs clipped (2-0)^2=4 equal, unclipped: grad 0.5*2*(2-0)/3
    assert v.grad[0].tolist() == pytest.approx([0.0, 1 / 3, 0.0, 2 / 3], abs=1e-12)


@pytest.mark.parametrize("only", [False, True])
def test_distillation_term_matches_reference(only):
    torch.manual_seed(9)
    n, t = 5, 8
    mask = ragged_mask(n, t, 9)
    s = -torch.rand(n, t, dtype=torch.float64) * 4
    te = -torch.rand(n, t, dtype=torch.float64) * 4
    s[~mask] = -math.inf  # padding may hold -inf
    te[~mask] = -math.inf
    adv = torch.randn(n, t, dtype=torch.float64).masked_fill(~mask, 0.0)
    out, m = distill_advantages(None if only else adv, s, te, mask, coef=0.3, only=only)
    kls = []
    for i in range(n):
        for j in range(t):
            if mask[i, j]:
                d = s[i, j].item() - te[i, j].item()
                kls.append(d)
                want = -0.3 * d if only else adv[i, j].item() - 0.3 * d
            else:
                want = 0.0
            assert abs(out[i, j].item() - want) <= 1e-12
    assert abs(m["distill/reverse_kl"].item() - sum(kls) / len(kls)) <= 1e-12
    assert torch.isfinite(reverse_kl_per_token(s, te, mask)).all()


def test_bad_inputs_raise_one_clear_error():
    mask = torch.ones(2, 3, dtype=torch.bool)
    z = torch.zeros(2, 3)
    with pytest.raises(AlgorithmInputError, match="gamma"):
        gae_advantages_returns(z, z, mask, gamma=1.5, lam=1.0)
    with pytest.raises(AlgorithmInputError, match="values has shape"):
        gae_advantages_returns(z, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    with pytest.raises(AlgorithmInputError, match="coef"):
        distill_advantages(z, z, z, mask, coef=0.0)
    with pytest.raises(AlgorithmInputError, match="only=True"):
        distill_advantages(None, z, z, mask, coef=1.0)


def verl_definition_gae(rewards, values, mask, gamma, lam):
    """verl's multi-turn GAE definition (core_algos.compute_gae_advantage_return), restated per scalar: at a
    mask-0 step the running advantage and the next value are carried unchanged; there the advantage is the
    carried value (verl masks it out downstream), we compare on model tokens only."""
    n, t = len(mask), len(mask[0])
    adv = [[0.0] * t for _ in range(n)]
    for i in range(n):
        next_v, last = 0.0, 0.0
        for j in reversed(range(t)):
            delta = rewards[i][j] + gamma * next_v - values[i][j]
            cand = delta + gamma * lam * last
            m = 1.0 if mask[i][j] else 0.0
            next_v = values[i][j] * m + (1 - m) * next_v
            last = cand * m + (1 - m) * last
            adv[i][j] = last
    return adv


def test_gae_agrees_with_verl_definition_on_model_tokens():
    torch.manual_seed(11)
    n, t = 8, 12
    mask = ragged_mask(n, t, 11)
    values = torch.randn(n, t, dtype=torch.float64)
    tok = final_token_rewards(torch.randn(n, dtype=torch.float64), mask)
    adv, _ = gae_advantages_returns(tok, values, mask, gamma=0.99, lam=0.95)
    want = torch.tensor(verl_definition_gae(tok.tolist(), values.tolist(), mask.tolist(), 0.99, 0.95),
                        dtype=torch.float64)
    torch.testing.assert_close(adv[mask], want[mask], rtol=0, atol=1e-12)
