"""algo.baseline=leave_one_out (mtrain/trainer/learner/leave_one_out.py) against the formula written out in float64,
the factory choosing it, and the config refusing what it cannot run with."""
import statistics
from types import SimpleNamespace

import pytest
import torch

from mtrain.config import ConfigError, load_config
from mtrain.trainer.learner.leave_one_out import LeaveOneOutBaseline, leave_one_out_advantages

CONFIG = "mtrain/configs/tiny_llama_grpo.yaml"


def _reference(rewards: list[float], n: int, norm: str, eps: float) -> list[float]:
    """A_i = r_i - mean_{j != i} r_j (then / (std_group + eps) for group_std), 0 for a uniform group; Python floats."""
    out = []
    for g in range(0, len(rewards), n):
        r = rewards[g:g + n]
        if len(set(r)) == 1:
            out += [0.0] * n
            continue
        for i in range(n):
            a = r[i] - sum(r[j] for j in range(n) if j != i) / (n - 1)
            out.append(a / (statistics.stdev(r) + eps) if norm == "group_std" else a)
    return out


@pytest.mark.parametrize("norm", ["none", "group_std"])
def test_matches_the_formula_in_float64(norm):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=gen, dtype=torch.float64)
    rewards[8:12] = 0.5  # one uniform group
    adv, metrics = leave_one_out_advantages(rewards, 4, norm=norm, eps=1e-6)
    want = torch.tensor(_reference(rewards.tolist(), 4, norm, 1e-6), dtype=torch.float64)
    assert adv.dtype == torch.float64 and torch.allclose(adv, want, rtol=0, atol=1e-12)
    assert (adv[8:12] == 0).all() and metrics["group/uniform_frac"] == pytest.approx(1 / 6)


def test_is_the_group_mean_baseline_scaled_by_n_over_n_minus_1():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    adv, _ = leave_one_out_advantages(r, 3, norm="none", eps=0.0)
    centred = (r.view(2, 3) - r.view(2, 3).mean(-1, keepdim=True)).reshape(-1)
    assert torch.allclose(adv, centred * 3 / 2, rtol=0, atol=1e-15)


def test_estimator_spreads_over_response_tokens_and_skips_filler_rows():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 9.0, 9.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    cfg = SimpleNamespace(adv_norm="none", adv_eps=1e-6)
    adv, _ = LeaveOneOutBaseline(cfg, 2)(SimpleNamespace(rewards=rewards, response_mask=mask), rows=4)
    assert adv.shape == (4, 3)  # rows past `rows` (the uniform-group filter's filler) are not estimated
    want = torch.tensor([[1.0, 1.0, 0], [-1.0, 0, 0], [-1.0, -1.0, -1.0], [0, 1.0, 1.0]], dtype=torch.float64)
    assert torch.equal(adv, want)


def test_the_factory_reads_it():
    from mtrain.trainer.learner.side_models import SideModels
    from mtrain.trainer.learner.advantages import GroupBaseline
    from mtrain.trainer.roles import _estimator
    cfg = load_config(CONFIG, ["algo.baseline=leave_one_out"])
    assert isinstance(_estimator(cfg, SideModels(cfg, 0, {}, None, {}, False)), LeaveOneOutBaseline)
    cfg = load_config(CONFIG, [])
    assert isinstance(_estimator(cfg, SideModels(cfg, 0, {}, None, {}, False)), GroupBaseline)


@pytest.mark.parametrize("extra, message", [
    (["algo.baseline=mean_of_others"], r"algo.baseline"),
    (["algo.baseline=leave_one_out", "algo.name=ppo"], r"^algo.baseline: leave_one_out is a critic-free baseline"),
    (["algo.baseline=leave_one_out", "algo.name=reinforce_pp"], r"^algo.baseline: leave_one_out with algo.adv_norm"),
    (["algo.baseline=leave_one_out", "rollout.samples_per_prompt=1", "train.micro_batch_size=1"],
     r"^algo.baseline: leave_one_out needs rollout.samples_per_prompt >= 2"),
])
def test_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(CONFIG, extra)
    assert "\n" not in str(e.value)
