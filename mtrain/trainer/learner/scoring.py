"""The learner's scoring part: the proximal logprobs every minibatch is trained against, and the engine-vs-trainer
gap (`logprob_diff/*`) that says how far the engine's sampler is from the trainer.

`Recompute` (numerics.on_policy=off): a forward pass of the weights that generated the rollout, before the first
update (the scoring pass); the gap is the engine's logprobs against it.

`EngineWhenCurrent` (numerics.on_policy=bitwise): the scoring pass would return the engine's logprobs bit for bit
whenever every trained token was sampled by the weights the trainer holds now (a synchronous rollout), since both
sides run the same kernels on the same weights. So it is skipped and the engine's logprobs are the proximal ones.
The gap is then measured, not assumed: the first update's forward runs those same weights and kernels on every
token of its minibatch (dropout is 0, `models/hf_config.py`), and the actor compares its logprobs with the engine's
before the optimizer steps (`Actor.probe_engine_gap`). A batch holding tokens of an older version (rollout.async,
rollout.partial) is scored as `Recompute` does. docs/design-on-policy.md, "The scoring pass".
"""
from __future__ import annotations

import torch

from mtrain.rollout.rollout_batch import RolloutBatch


def logprob_diff(old_lp, batch: RolloutBatch) -> dict[str, float]:
    if old_lp is None:
        return {}
    m = batch.response_mask.bool()
    d = (old_lp - batch.engine_logprobs).abs()[m]
    if d.numel() == 0:
        return {}
    return {"logprob_diff/mean_abs": float(d.mean()), "logprob_diff/max_abs": float(d.max())}


class Recompute:
    """Every minibatch scored by the trainer (the actor's no-grad forward)."""

    def __init__(self, actor):
        self.actor = actor

    def begin(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        return {"logprobs/scored": 1.0}

    def logprobs(self, mb: RolloutBatch) -> torch.Tensor | None:
        return self.actor.logprobs(mb)

    def gap(self, old_lp, scored: RolloutBatch) -> dict[str, float]:
        return logprob_diff(old_lp, scored)


class EngineWhenCurrent(Recompute):
    """The engine's logprobs as the proximal ones when every trained token is of the trainer's weight version."""

    def __init__(self, actor):
        super().__init__(actor)
        self._engine = False

    def begin(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        m = batch.response_mask.bool()
        self._engine = bool((batch.versions[m] == step).all())
        # the first update's forward measures the gap (Actor.forward_backward clears the flag after one pass)
        self.actor.probe_engine_gap = self._engine
        return {"logprobs/scored": 0.0 if self._engine else 1.0}

    def logprobs(self, mb: RolloutBatch) -> torch.Tensor | None:
        if not self._engine:
            return self.actor.logprobs(mb)
        return mb.engine_logprobs * mb.response_mask  # 0 off the mask, as the engine records them

    def gap(self, old_lp, scored: RolloutBatch) -> dict[str, float]:
        return self.actor.take_engine_gap() if self._engine else logprob_diff(old_lp, scored)
