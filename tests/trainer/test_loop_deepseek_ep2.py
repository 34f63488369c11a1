"""The tiny DeepSeek-V3 (MLA with q-LoRA, 8 routed + 1 shared expert, sigmoid router with expert bias, group-limited
top-k, a first dense layer) through the whole GRPO loop with expert parallelism 2 on 2 CPU ranks: step 1 scores and
trains the same policy, and the engine (reference, fed by the planner every step) always agrees with Megatron."""
from __future__ import annotations

import pytest

from loop_harness import base_overrides, launch, train_records


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("deepseek_v3", tmp_path_factory.mktemp("hf") / "deepseek_v3", seed=0)


def test_grpo_deepseek_v3_ep2(tiny_deepseek, tmp_path):
    run = tmp_path / "run"
    launch(base_overrides(tiny_deepseek, run, **{"parallel.tp": 1, "parallel.ep": 2, "train.steps": 2}), cwd=tmp_path,
           timeout=300)
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    first = recs[1]
    assert first["ppo/clipfrac"] == 0.0 and first["ppo/approx_kl"] == 0.0 and first["kl/mean"] == 0.0
    for step, rec in recs.items():
        assert rec["logprob_diff/max_abs"] <= 1e-5, (step, rec["logprob_diff/max_abs"])
        assert rec["weight_version"] == step
    assert recs[2]["kl/mean"] > 0.0  # the first update moved the policy away from the reference
