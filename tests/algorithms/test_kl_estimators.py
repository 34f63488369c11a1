"""KL estimators k1/k2/k3, the approx-KL metric and entropy, against float64 math."""
import math

import pytest
import torch

from mtrain.algorithms import AlgorithmInputError, approx_kl, entropy_from_logits, kl_estimate


def test_estimators_match_schulmans_formulas():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 4
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 3:] = False
    formulas = {  # log r = log p_ref - log p_policy
        "k1": lambda lr: -lr, "k2": lambda lr: 0.5 * lr * lr, "k3": lambda lr: (math.exp(lr) - 1) - lr,
    }
    for kind, f in formulas.items():
        got = kl_estimate(logp, ref, mask, kind)
        for i in range(4):
            for j in range(6):
                want = f(float(ref[i, j] - logp[i, j])) if mask[i, j] else 0.0
                assert got[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, i, j)
    assert (kl_estimate(logp, ref, mask, "k2") >= 0).all() and (kl_estimate(logp, ref, mask, "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_for_kl_policy_to_reference():
    # Sample from the policy q and check the estimators' means against the exact KL(q || p).
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(5, dtype=torch.float64, generator=g), 0)
    p = torch.softmax(torch.randn(5, dtype=torch.float64, generator=g), 0)
    exact = float((q * (q.log() - p.log())).sum())
    x = torch.multinomial(q, 400_000, replacement=True, generator=g)[None, :]
    mask = torch.ones_like(x, dtype=torch.bool)
    for kind in ("k1", "k3"):
        est = kl_estimate(q.log()[x], p.log()[x], mask, kind).mean().item()
        assert est == pytest.approx(exact, rel=0.03), kind


def test_equal_distributions_give_exactly_zero_and_garbage_is_masked():
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]])
    mask = torch.tensor([[True, True, False]])
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(logp, logp.clone(), mask, kind), torch.zeros(1, 3))
    assert approx_kl(logp, logp.clone(), mask).item() == 0.0
    assert approx_kl(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.0, float("nan")]]),
                     torch.tensor([[True, False]])).item() == 0.0


def test_k3_stays_finite_for_huge_log_ratios():
    kl = kl_estimate(torch.tensor([[-200.0, 0.0]]), torch.tensor([[0.0, -200.0]]),
                     torch.ones(1, 2, dtype=torch.bool), "k3")
    assert torch.isfinite(kl).all()


def test_unknown_estimator():
    with pytest.raises(AlgorithmInputError, match="unknown KL estimator 'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k4")


def test_entropy_from_logits_matches_reference_and_chunking():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    ent = entropy_from_logits(logits, chunk_rows=4)
    for i in range(3):
        for j in range(5):
            z = [math.exp(v) for v in logits[i, j].tolist()]
            probs = [v / sum(z) for v in z]
            want = -sum(p * math.log(p) for p in probs)
            assert ent[i, j].item() == pytest.approx(want, rel=1e-5)  # computed in float32
    assert ent.dtype == torch.float32 and ent.shape == (3, 5)
    torch.testing.assert_close(ent, entropy_from_logits(logits, chunk_rows=1000))
    uniform = entropy_from_logits(torch.zeros(2, 7, dtype=torch.bfloat16))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(7)), rtol=1e-6, atol=1e-6)
