"""GRPO through the front (examples/openai_agent/grpo_through_front.py): openai-client agents, recorded sessions,
to_batch, a policy step, new weights pushed every step. The reward (the second answer holds a digit: about 0.4 for
the random model) must rise (the run is seeded: the same tokens every time); every recorded token carries the version of the weights that sampled it and
the engine's logprobs equal the policy's recomputation."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def test_reward_rises_through_the_front():
    path = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "grpo_through_front.py"
    spec = importlib.util.spec_from_file_location("grpo_through_front", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(steps=12, groups=4, n=8)
    assert res["reward_last"] >= res["reward_first"] + 0.3, res["history"]
    assert all(r["logprob_diff_max"] < 1e-3 and r["rerendered"] == 0 and r["trajectories"] == 32
               for r in res["history"])
