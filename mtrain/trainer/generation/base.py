"""The generation-function role: what any rollout source calls to turn prompts into scored groups.

A generation function takes the pool to run on (a source may drive a pool of its own: one_step and stream run a
second one in a background thread) and a step's prompts, and returns a `RolloutResult` whose completions or
trajectories carry per-token versions. Implementations: `mtrain.trainer.generation.functions` (single-turn,
multi-turn tools) and `mtrain.trainer.generation.agents` (agents through the OpenAI front).
"""
from __future__ import annotations

from typing import Protocol

from mtrain.trainer.generation.rollouts import RolloutResult


class GenerationFunction(Protocol):
    # True where the result's trajectories carry the tool metrics an evaluation reports (multi-turn tools)
    reports_tool_metrics: bool

    def __call__(self, pool, samples, *, n: int, seed: int, prefix: str, greedy: bool = False,
                 max_new_tokens: int | None = None) -> RolloutResult: ...

    def close(self) -> None: ...
