"""compute_advantages / policy_loss: the config-driven entry points compose the parts as documented."""
import pytest
import torch

from mtrain.algorithms import (AlgorithmInputError, aggregate_loss, compute_advantages, gspo_loss,
                               group_advantages, kl_estimate, policy_loss, ppo_clip_loss,
                               reinforce_pp_baseline_advantages)
from mtrain.config import load_config
from mtrain.config_sections import AlgoConfig


def algo(name="grpo", *overrides):
    return load_config(None, ["model.hf_path=x", "data.task=arithmetic", f"algo.name={name}", *overrides]).algo


def batch(seed=0, b=8, t=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    logp = old + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    rewards = torch.randint(0, 2, (b,), generator=g).double()
    return logp, old, ref, mask, rewards


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"])
def test_compute_advantages_dispatches_on_adv_norm(name):
    _, _, _, mask, rewards = batch()
    a = algo(name)
    adv, metrics = compute_advantages(a, rewards, 4, mask)
    if a.adv_norm == "batch_std":
        want, _ = reinforce_pp_baseline_advantages(rewards, 4, mask, eps=a.adv_eps)
    else:
        seq, _ = group_advantages(rewards, 4, norm=a.adv_norm, eps=a.adv_eps)
        want = torch.where(mask, seq[:, None].expand(mask.shape), torch.zeros(()).double())
    torch.testing.assert_close(adv, want, rtol=0, atol=0)
    assert "group/uniform_frac" in metrics


def test_policy_loss_is_pg_plus_kl_minus_entropy():
    logp, old, ref, mask, rewards = batch(1)
    a = algo("grpo", "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "algo.kl_estimator=k2")
    adv, _ = compute_advantages(a, rewards, 4, mask)
    entropy = torch.rand(mask.shape, dtype=torch.float64)
    loss, m = policy_loss(a, logp, old, adv, mask, ref_logprobs=ref, entropy=entropy)
    pg, _ = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, loss_agg=a.loss_agg)
    kl = aggregate_loss(kl_estimate(logp, ref, mask, "k2"), mask, a.loss_agg)
    ent = aggregate_loss(entropy, mask, a.loss_agg)
    assert loss.item() == pytest.approx((pg + 0.05 * kl - 0.01 * ent).item(), rel=1e-12)
    assert m["loss/total"].item() == loss.item() and m["kl/mean"].item() > 0 and "entropy/mean" in m


def test_gspo_and_dual_clip_dispatch():
    logp, old, _, mask, rewards = batch(2)
    a = algo("gspo")
    adv, _ = compute_advantages(a, rewards, 4, mask)
    loss, m = policy_loss(a, logp, old, adv, mask)
    want, _ = gspo_loss(logp, old, adv, mask, clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg=a.loss_agg)
    assert loss.item() == want.item() and "ppo/clipfrac_seq" in m and "kl/mean" not in m
    with pytest.raises(AlgorithmInputError, match="dual_clip_c applies to token-level PPO clipping"):
        policy_loss(algo("gspo", "algo.dual_clip_c=3"), logp, old, adv, mask)
    d = algo("dapo", "algo.dual_clip_c=3")
    _, m = policy_loss(d, logp, old, adv, mask)
    assert "ppo/clipfrac_dual" in m


def test_truncated_importance_sampling_weights_the_loss():
    logp, old, _, mask, rewards = batch(3)
    rollout = old + 0.5 * torch.randn(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    a = algo("dapo", "algo.tis_cap=2.0")
    adv, _ = compute_advantages(a, rewards, 4, mask)
    loss, m = policy_loss(a, logp, old, adv, mask, rollout_logprobs=rollout)
    weights = torch.where(mask, torch.exp(old - rollout).clamp(max=2.0), torch.zeros(()).double())
    want, _ = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token_mean",
                            is_weights=weights)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12) and weights.max() == 2.0
    assert m["tis/weight_mean"].item() == pytest.approx(weights[mask].mean().item())
    ratio = torch.exp(old - rollout)[mask]
    capped = (ratio >= 2.0).double().mean().item()
    assert 0 < capped < 1 and m["tis/capped_frac"].item() == pytest.approx(capped)
    with pytest.raises(AlgorithmInputError, match="tis_cap is set but rollout_logprobs"):
        policy_loss(a, logp, old, adv, mask)


def test_missing_inputs_name_the_setting():
    logp, old, ref, mask, _ = batch()
    adv = torch.zeros_like(logp)
    with pytest.raises(AlgorithmInputError, match="algo.kl_coef=0.001 needs ref_logprobs"):
        policy_loss(algo("grpo"), logp, old, adv, mask)
    with pytest.raises(AlgorithmInputError, match="algo.entropy_coef=0.1 needs the per-token entropy"):
        policy_loss(algo("dapo", "algo.entropy_coef=0.1"), logp, old, adv, mask)
    with pytest.raises(AlgorithmInputError, match="algo.clip_eps_low is unset: resolve presets first"):
        policy_loss(AlgoConfig(), logp, old, adv, mask)
    with pytest.raises(AlgorithmInputError, match=r"ref_logprobs has shape \(8, 5\)"):
        policy_loss(algo("grpo"), logp, old, adv, mask, ref_logprobs=ref[:, :5])


def test_first_step_metrics_are_exact_and_loss_backprops():
    logp, _, ref, mask, rewards = batch(4)
    a = algo("grpo")
    adv, _ = compute_advantages(a, rewards, 4, mask)
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(a, lp, logp.clone(), adv, mask, ref_logprobs=ref)
    loss.backward()
    assert m["ppo/clipfrac"].item() == 0.0 and m["ppo/approx_kl"].item() == 0.0
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all() and lp.grad[mask].abs().sum() > 0
