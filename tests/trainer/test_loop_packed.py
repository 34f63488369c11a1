"""The RL loop with packed micro-batches (train.max_tokens_per_micro_batch) under torchrun on 2 ranks, as 2
data-parallel ranks (samples split by token count) or as 2 context-parallel ranks (every sequence split over
both): the trainer's logprobs still equal the reference engine's (transformers) within float32 tolerance at
every step."""
from __future__ import annotations

import math

import pytest
from loop_harness import base_overrides, launch, train_records


@pytest.mark.slow  # about 70 s on 2 cores; the Actor-level equalities run by default (test_packing_numerics.py)
@pytest.mark.parametrize("layout", ["dp2", "cp2"])
def test_packed_loop(tmp_path, layout):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("qwen3", tmp_path / "hf", seed=0)
    run = tmp_path / "run"
    # tiny_llama_grpo.yaml: max_prompt_len 64 + max_new_tokens 8 = 72 <= the budget
    extra = {"parallel.cp": 2} if layout == "cp2" else {}
    launch(base_overrides(hf, run, **{"train.steps": 2, "parallel.tp": 1, "train.max_tokens_per_micro_batch": 80,
                                      **extra}), cwd=tmp_path)
    recs = train_records(run)
    assert sorted(recs) == [1, 2]
    for step, rec in recs.items():
        assert rec["logprob_diff/max_abs"] <= 1e-5, (step, rec["logprob_diff/max_abs"])
        assert math.isfinite(rec["loss/total"]) and rec["grad_norm"] > 0, (step, rec)
