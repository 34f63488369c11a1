"""The RL loop under torchrun on 2 ranks with context parallelism on padded micro-batches (no token budget), and
CP x EP for a MoE model with packed ones (issue 18): the trainer's logprobs equal the reference engine's
(transformers) within float32 tolerance at every step. The Actor-level equalities (loss, gradients, TP/PP/EP
combinations) are in test_cp_combined.py."""
from __future__ import annotations

import math

import pytest
from loop_harness import base_overrides, launch, train_records

CASES = {  # name: (architecture, overrides)
    "cp2_padded_qwen3": ("qwen3", {"parallel.cp": 2}),
    "cp2_ep2_packed_qwen3_moe": ("qwen3_moe", {"parallel.cp": 2, "parallel.ep": 2,
                                               "train.max_tokens_per_micro_batch": 40}),
}


@pytest.mark.slow  # about 1-2 min each on 2 shared cores
@pytest.mark.parametrize("name", list(CASES))
def test_loop_with_context_parallelism(tmp_path, name):
    from mtrain.tiny_hf import write_tiny_hf
    arch, extra = CASES[name]
    hf = write_tiny_hf(arch, tmp_path / "hf", seed=0)
    run = tmp_path / "run"
    # tiny_llama_grpo.yaml: max_prompt_len 64 + max_new_tokens 8 = 72 <= 2 x 40 (cp x the budget)
    launch(base_overrides(hf, run, **{"train.steps": 2, "parallel.tp": 1, **extra}), cwd=tmp_path, timeout=600)
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    for step, rec in recs.items():
        assert rec["logprob_diff/max_abs"] <= 1e-5, (step, rec["logprob_diff/max_abs"])
        assert math.isfinite(rec["loss/total"]) and rec["grad_norm"] > 0, (step, rec)
