"""The learner role and the parts its objective is composed of.

A learner turns a step's scored trajectories into one update of the policy (and of its side models): it builds the
batch, takes out what the source calls stale, computes the advantages with one *estimator*, lets each *term* adjust
them per minibatch (distillation from a teacher; the KL reference and the entropy bonus are terms of the policy's
loss, algo.kl_coef / algo.entropy_coef) and runs the PPO minibatches. It owns the training state a checkpoint holds.

    estimator(batch, rows) -> ([B, T-1] advantages, metrics)       learner/advantages.py
    term.advantages(mb, adv, logprobs) -> adv; term.metrics()      learner/teacher.py (Distiller)
    scorer.begin(batch, step); scorer.logprobs(mb); scorer.gap(...)  learner/scoring.py (proximal logprobs, gap)

Implementations: `PolicyLearner` (learner/policy.py, the training ranks) and `NoLearner` (learner/engine_rank.py:
the engine ranks of separate placement, which hold no model).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    def __call__(self, batch, rows: int) -> tuple[torch.Tensor, dict]:
        """Advantages of the batch's first `rows` rows (the rest: filler of the uniform-group filter)."""
        ...


class AdvantageTerm(Protocol):
    def advantages(self, mb, adv: torch.Tensor, logprobs: torch.Tensor | None) -> torch.Tensor: ...

    def metrics(self) -> dict[str, float]: ...


class Scorer(Protocol):
    def begin(self, batch, step: int) -> dict[str, float]:
        """Decide how this step's batch is scored (before any minibatch); returns its metrics."""

    def logprobs(self, mb) -> torch.Tensor | None:
        """The proximal logprobs [B, T-1] of one minibatch, before the first update (None off the last stage)."""

    def gap(self, old_lp: torch.Tensor, scored) -> dict[str, float]:
        """logprob_diff/* of the step: the engine's logprobs against the trainer's."""


class Learner(Protocol):
    def begin(self, step: int) -> None:
        """Before the step's rollout: training state leaves the device (engine.offload_train), critic warm-up."""

    def learn(self, res, step: int, source) -> tuple[dict[str, float], dict[str, float]]:
        """One update from `res`; returns (this rank's metrics, reduced over ranks; the step's summary)."""

    def report(self, local: dict[str, float]) -> dict[str, float]:
        """What this rank gives to the job's metric reduction."""

    def reload(self) -> None:
        """Bring offloaded state back (before a checkpoint)."""

    def save(self, run_dir: Path, step: int, state: dict) -> None: ...

    def load(self, path: Path) -> dict: ...
