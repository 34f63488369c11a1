"""Group advantages against float64 Python math written out here."""
import math
import statistics

import pytest
import torch

from mtrain.algorithms import (AlgorithmInputError, group_advantages, reinforce_pp_baseline_advantages,
                               token_advantages, uniform_groups)


def ref_group(rewards: list[float], g: int, norm: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start:start + g]
        mean = sum(grp) / g
        std = statistics.stdev(grp)  # unbiased, like torch.std
        out += [0.0 if len(set(grp)) == 1 else (x - mean) / (std + eps) if norm else x - mean for x in grp]
    return out


@pytest.mark.parametrize("norm", ["group_std", "none"])
def test_group_advantages_match_reference(norm):
    torch.manual_seed(0)
    rewards = torch.rand(24, dtype=torch.float64)
    rewards[4:8] = 1.0  # one uniform group
    adv, metrics = group_advantages(rewards, 4, norm=norm, eps=1e-6)
    expected = ref_group(rewards.tolist(), 4, norm == "group_std", 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert metrics["group/uniform_frac"].item() == pytest.approx(1 / 6)
    assert metrics["adv/max"].item() == pytest.approx(max(expected))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1 / 3, -7.25])
def test_all_equal_rewards_give_exactly_zero(value):
    # mean of [0.1]*3 is 0.10000000000000002 in floating point: the subtraction alone would not give 0
    rewards = torch.tensor([value] * 3 + [0.0, 1.0, 1.0], dtype=torch.float32)
    for norm in ("group_std", "none"):
        adv, _ = group_advantages(rewards, 3, norm=norm)
        assert torch.equal(adv[:3], torch.zeros(3)) and torch.isfinite(adv).all()
    mask = torch.ones(6, 4, dtype=torch.bool)
    adv, _ = reinforce_pp_baseline_advantages(torch.full((6,), value), 3, mask)
    assert torch.equal(adv, torch.zeros(6, 4))  # every group uniform: no signal, no NaN


def test_integer_rewards_and_uniform_groups():
    rewards = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0])
    adv, _ = group_advantages(rewards, 4)
    assert adv.dtype == torch.float32 and adv[4:].eq(0).all()
    assert uniform_groups(torch.tensor([1, 1, 0, 1, 1, 0, 0, 0]), 2).tolist() == [True, False, False, True]


def test_reinforce_pp_baseline_matches_reference():
    torch.manual_seed(1)
    g, b, t = 4, 12, 7
    rewards = torch.randint(0, 3, (b,)).double()
    lengths = torch.randint(1, t + 1, (b,))
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv, metrics = reinforce_pp_baseline_advantages(rewards, g, mask, eps=1e-6)
    r = rewards.tolist()
    centred = []
    for start in range(0, b, g):
        grp = r[start:start + g]
        centred += [x - sum(grp) / g for x in grp]
    tokens = [centred[i] for i in range(b) for _ in range(int(lengths[i]))]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    expected = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        expected[i, : int(lengths[i])] = (centred[i] - mean) / math.sqrt(var + 1e-6)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    assert abs(metrics["adv/mean"].item()) < 1e-6  # whitened over valid tokens


def test_token_advantages_spread_over_valid_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = token_advantages(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


@pytest.mark.parametrize("rewards, group_size, message", [
    (torch.ones(6), 1, "group_size must be >= 2"),
    (torch.ones(7), 2, "rewards has 7 entries, not a positive multiple of group_size=2"),
    (torch.ones(2, 3), 3, r"rewards must be \[batch\], got shape \(2, 3\)"),
    (torch.tensor([1.0, float("nan")]), 2, "rewards contain NaN or inf"),
])
def test_bad_inputs(rewards, group_size, message):
    with pytest.raises(AlgorithmInputError, match=message):
        group_advantages(rewards, group_size)
    with pytest.raises(AlgorithmInputError, match="norm must be 'group_std' or 'none'"):
        group_advantages(torch.ones(4), 2, norm="batch")
    with pytest.raises(AlgorithmInputError, match="mask has 3 rows but rewards has 4"):
        reinforce_pp_baseline_advantages(torch.ones(4), 2, torch.ones(3, 2, dtype=torch.bool))
