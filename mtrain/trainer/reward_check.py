"""The one gate between a rollout's rewards and the batch: every source and generation function's result passes here.

A reward set by user code (a multi_turn.rollout_fn's trajectories, an agent's score, a partial rollout's resumed
group) is refused when it is not one finite number, in one RewardError naming the sample, before any batch is built:
a NaN would otherwise reach every advantage of its group (and, through the critic's whitening, the whole update).
"""
from __future__ import annotations

from mtrain.data.rewards import finite_reward
from mtrain.trainer.generation.rollouts import RolloutResult


def _name(item) -> str:
    sample = getattr(item, "sample", None)
    index = getattr(sample, "index", None)
    kind = "trajectory" if hasattr(item, "segments") else "completion"
    return f"{kind} {item.rid!r}" + (f" of sample {index}" if index is not None else "")


def checked_rewards(res: RolloutResult) -> RolloutResult:
    """`res` with every reward a finite float (trajectories' own `reward` too: the batch is built from those)."""
    if res.trajectories is not None:
        for t in res.trajectories:
            t.reward = finite_reward(t.reward, f"the reward of {_name(t)}")
        res.rewards = [t.reward for t in res.trajectories]
    else:
        res.rewards = [finite_reward(r, f"the reward of {_name(c)}") for r, c in zip(res.rewards, res.completions)]
    return res
