"""Every reward reaches the batch through one gate (mtrain/trainer/reward_check.py), whatever the source: a NaN set by
a custom multi_turn.rollout_fn under rollout.partial (whose buffer once took rewards with a bare float(), so PPO
trained on NaN) stops the run with one error naming the trajectory and its sample, before anything is trained."""
import json
import re

from loop_harness import base_overrides, env, torchrun_cmd


def test_nan_reward_from_a_partial_multi_turn_rollout_fn_is_one_clear_error(tmp_path):
    import subprocess

    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 1024})
    run_dir = tmp_path / "run"
    over = {"multi_turn.rollout_fn": "tests.trainer.nan_rollout_fn:rollout_group", "multi_turn.max_turns": 2,
            "multi_turn.max_total_tokens": 700, "train.steps": 2, "rollout.prompts_per_step": 2,
            "rollout.samples_per_prompt": 2, "train.micro_batch_size": 2, "rollout.max_prompt_len": 600,
            "rollout.partial": "true", "rollout.max_new_tokens": 24}
    p = subprocess.run(torchrun_cmd(base_overrides(hf, run_dir, **over)), cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=400)
    assert p.returncode != 0
    lines = set(re.findall(r"RewardError: .*", p.stderr))
    assert len(lines) == 1, p.stderr[-4000:]  # the same one line on every rank
    (line,) = lines
    assert re.fullmatch(r"RewardError: the reward of trajectory 's0-g\d+-0-' of sample \d+ returned nan; "
                        r"expected a finite number", line), line
    trained = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    assert trained == []  # nothing was trained on it
