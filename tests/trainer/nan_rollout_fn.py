"""A user rollout function (multi_turn.rollout_fn) whose reward for the first trajectory of every group is NaN: the
shape of a custom scorer that divides by zero. Its module has the resume_group partial rollout needs."""
from mtrain.rollout.agents.multi_turn import resume_group  # noqa: F401 - partial rollout resumes aborted trajectories
from mtrain.rollout.agents.multi_turn import rollout_group as _tool_rollout


async def rollout_group(sample, n, client, ctx):
    trajectories = await _tool_rollout(sample, n, client, ctx)
    trajectories[0].reward = float("nan")
    return trajectories
