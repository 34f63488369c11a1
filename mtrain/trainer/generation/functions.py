"""The generation functions of single-turn and multi-turn tool rollouts (the `GenerationFunction` role)."""
from __future__ import annotations

from mtrain.trainer.generation.rollouts import RolloutResult, run_multi_turn_rollout, run_rollout


class SingleTurn:
    """One response per request: prompts -> groups of n samples -> rewards (rollouts.run_rollout)."""
    reports_tool_metrics = False

    def __init__(self, cfg, tokenizer, reward_fn, max_positions: int | None):
        self.cfg, self.tokenizer, self.reward_fn, self.max_positions = cfg, tokenizer, reward_fn, max_positions

    def __call__(self, pool, samples, *, n, seed, prefix, greedy=False, max_new_tokens=None) -> RolloutResult:
        return run_rollout(pool, self.tokenizer, samples, self.cfg, self.reward_fn, n=n, seed=seed, rid_prefix=prefix,
                           greedy=greedy, max_positions=self.max_positions, max_new_tokens=max_new_tokens)

    def close(self) -> None:
        pass


class MultiTurnTools(SingleTurn):
    """multi_turn.rollout_fn: the user's group function drives tool calls turn by turn (docs/design-tools.md)."""
    reports_tool_metrics = True

    def __init__(self, cfg, tokenizer, reward_fn, max_positions: int | None, tools, rollout_fn):
        super().__init__(cfg, tokenizer, reward_fn, max_positions)
        self.tools, self.rollout_fn = tools, rollout_fn

    def __call__(self, pool, samples, *, n, seed, prefix, greedy=False, max_new_tokens=None) -> RolloutResult:
        return run_multi_turn_rollout(pool, self.tokenizer, samples, self.cfg, self.reward_fn, self.tools,
                                      self.rollout_fn, n=n, seed=seed, rid_prefix=prefix, greedy=greedy,
                                      max_positions=self.max_positions, max_new_tokens=max_new_tokens)
