"""reward.judge in a real run: `torchrun --nproc-per-node 2 -m mtrain train ... reward.judge.hf_path=DIR`, 2 GRPO steps
on the CPU reference engines. Every rank's rewards come from its own judge engine (a tiny random model of its own
checkpoint, never synced): the step logs judge/calls for every sample, and the run ends with the judge shut down."""
import json

from loop_harness import base_overrides, launch

TEMPLATE = "Q: {prompt} A: {answer} R: {response} Score:"


def test_a_run_scores_every_sample_with_its_judge(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 512})
    judge = write_tiny_hf("llama", tmp_path / "judge", seed=1,
                          overrides={"max_position_embeddings": 512, "initializer_range": 1.0})
    run_dir = tmp_path / "run"
    over = base_overrides(hf, run_dir, **{"train.steps": 2, "rollout.prompts_per_step": 2,
                                          "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8,
                                          "reward.judge.hf_path": judge, "reward.judge.template": TEMPLATE,
                                          "reward.judge.parser": "score", "reward.judge.max_new_tokens": 4})
    launch(over, tmp_path, timeout=400)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the leader's judge scored its rank's share: 2 prompts x 2 samples over 2 data-parallel ranks
        assert r["judge/calls"] >= 2, r
        assert 0 <= r["judge/unparsed"] <= r["judge/calls"] and r["judge/errors"] == r["judge/timeouts"] == 0, r
