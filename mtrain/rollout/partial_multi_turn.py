"""Partial rollout of multi-turn tool trajectories: a GRPO group of trajectories that survives an abort.

The single-turn model (mtrain/rollout/partial.py) keeps per-sample tokens; here a group keeps its `Trajectory`
objects as they stood at the abort: every segment (prompt, model turns with per-token logprobs and weight versions,
environment turns), the chat messages, the turn count and the tool session's call log. Next step the group is
resumed at the same turn by the rollout function's module-level `resume_group(trajectories, client, ctx)`
(mtrain.rollout.agents.multi_turn has one): a fresh tool session replays the logged calls (so stateful tools are
where they were), then the aborted model turn continues from its partial tokens on the new weights, a turn may span
two versions. Finished trajectories (reward set) are not run again.

Request ids: every step's requests must start with that step's prefix (the pool aborts by prefix at the quota), so
a group's trajectories are renamed f"{step prefix}-g{uid}-{j}-" before each run; seeds stay the group's own
(`base_seed` fixed per group), so a resumed turn draws from its seed stream (advanced per abort).
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

from mtrain.rollout.agents.multi_turn import group_rids
from mtrain.rollout.trajectory import Segment, Trajectory


@dataclass
class TrajectoryGroup:
    uid: int  # unique over the run: names its requests
    sample_index: int  # index into the training set
    trajectories: list[Trajectory] | None = None  # None until its first run

    @property
    def finished(self) -> bool:
        return self.trajectories is not None and all(t.reward is not None for t in self.trajectories)

    @property
    def rewards(self) -> list[float] | None:
        return [float(t.reward) for t in self.trajectories] if self.finished else None

    def versions(self) -> list[int]:
        return [v for t in self.trajectories or [] for s in t.segments if s.trained for v in s.versions]

    def oldest_version(self) -> int | None:
        vs = self.versions()
        return min(vs) if vs else None

    def started(self) -> bool:
        return any(s.trained and s.ids for t in self.trajectories or [] for s in t.segments)


def resume_fn_of(rollout_fn: Callable) -> Callable:
    """The `resume_group` next to a rollout function (its module), which partial rollout needs."""
    module = importlib.import_module(rollout_fn.__module__)
    fn = getattr(module, "resume_group", None)
    if fn is None:
        raise ValueError(f"rollout.partial with multi_turn.rollout_fn {rollout_fn.__module__}:"
                         f"{rollout_fn.__qualname__}: its module has no resume_group(trajectories, client, ctx) to "
                         "continue aborted trajectories (mtrain.rollout.agents.multi_turn:rollout_group has one)")
    return fn


async def advance(group: TrajectoryGroup, sample, n: int, client, ctx, rollout_fn: Callable, resume_fn: Callable,
                  filter_uniform: bool) -> tuple[bool, TrajectoryGroup]:
    """Run a group's new or aborted trajectories until they finish or the pool aborts them.
    Returns (counts toward the step's quota, the group); ctx.rid_prefix is this step's name for the group."""
    if group.trajectories is None:
        group.trajectories = list(await rollout_fn(sample, n, client, ctx))
    elif not group.finished:
        for t, rid in zip(group.trajectories, group_rids(ctx, len(group.trajectories))):
            t.rid = rid  # this step's prefix: the quota's abort must reach its requests
        group.trajectories = list(await resume_fn(group.trajectories, client, ctx))
    if not group.finished:
        return False, group
    rewards = group.rewards
    return not (filter_uniform and len(set(rewards)) == 1), group


def to_state(groups: list[TrajectoryGroup]) -> list[dict[str, Any]]:
    """Plain data for checkpoints; the prompt sample is stored by its index (rebuilt from the dataset), the images
    (VisionInputs) as their tensors: a resumed trajectory's turns carry the same pixel values."""
    out = []
    for g in groups:
        trajs = None if g.trajectories is None else [
            {**asdict(t), "sample": None, "vision": None if t.vision is None else t.vision.to_state()}
            for t in g.trajectories]
        out.append({"uid": g.uid, "sample_index": g.sample_index, "trajectories": trajs})
    return out


def from_state(state: list[dict[str, Any]], dataset) -> list[TrajectoryGroup]:
    from mtrain.data.vision import VisionInputs
    state = copy.deepcopy(state)  # the groups grow in place as they resume: never into the caller's state
    groups = []
    for g in state:
        trajs = None
        if g["trajectories"] is not None:
            trajs = [Trajectory(**{**t, "segments": [Segment(**s) for s in t["segments"]],
                                   "sample": dataset[g["sample_index"]],
                                   "vision": VisionInputs.from_state(t.get("vision"))}) for t in g["trajectories"]]
        groups.append(TrajectoryGroup(g["uid"], g["sample_index"], trajs))
    return groups
