"""The learner of an engine rank (engine.placement=separate): no model, no optimizer, no metrics of its own.

It still enters the collectives the training ranks' learner runs over the default group, at the same points:
megatron-core's optimizer construction (at start) and dist_checkpointing's save and load (`checkpoint.
save_without_model` / `load_without_model`: the step and the sources' state from trainer_state.pt).
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from mtrain.trainer import checkpoint

# default-group gathers in megatron-core 0.16.1's get_megatron_optimizer without overlapped parameter gathers
OPTIMIZER_GATHERS = 2


class NoLearner:
    """extra_models: the names of the training ranks' further trained models (PPO's "critic"): each has an optimizer
    built at start and a part of every checkpoint, whose collectives this rank joins."""

    def __init__(self, extra_models: tuple[str, ...] = ()):
        self.extra_models = tuple(extra_models)
        # get_megatron_optimizer aligns parameter groups over the default group (an all_gather_object of their keys
        # per call of _get_param_groups_and_buffers: the dense chunks', then the expert parameters'): the policy's
        # optimizer is built on the training ranks at this point of their start, so this rank joins with no keys.
        for _ in range(OPTIMIZER_GATHERS * (1 + len(self.extra_models))):
            dist.all_gather_object([None] * dist.get_world_size(), [])

    def begin(self, step: int) -> None:
        pass

    def learn(self, res, step: int, source) -> tuple[dict[str, float], dict[str, float]]:
        return {}, {}

    def report(self, local: dict[str, float]) -> dict[str, float]:
        return {}  # the job's metrics are the training ranks'

    def reload(self) -> None:
        pass

    def save(self, run_dir: Path, step: int, state: dict) -> None:
        # the training ranks write; this rank joins their collectives
        checkpoint.save_without_model(run_dir, step, self.extra_models)

    def load(self, path: Path) -> dict:
        # the training ranks' load runs collectives over the job
        return checkpoint.load_without_model(path, self.extra_models)
