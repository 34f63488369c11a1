"""train.global_batch_size below the rollout batch: several optimizer steps per rollout (PPO minibatches), each
scored by the rollout policy before the first update, and the engine still agrees with Megatron afterwards."""
from __future__ import annotations

from loop_harness import base_overrides, launch, train_records


def test_two_minibatches_per_rollout(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0)
    run = tmp_path / "run"
    # tiny_llama_grpo.yaml: 4 prompts x 4 samples = 16 rows; 8 per optimizer step -> 2 updates per rollout
    launch(base_overrides(hf, run, **{"train.steps": 2, "train.global_batch_size": 8}), cwd=tmp_path)
    recs = train_records(run)
    for step, rec in recs.items():
        assert rec["ppo/updates"] == 2.0
        assert rec["logprob_diff/max_abs"] <= 1e-5, (step, rec["logprob_diff/max_abs"])
    # The second minibatch of step 1 is trained by a policy that already took one step: ratios move off 1.
    assert recs[1]["ppo/ratio_max"] > 1.0 or recs[1]["ppo/ratio_min"] < 1.0
