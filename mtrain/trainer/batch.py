"""Rollout results -> the padded training batch (`mtrain.rollout.rollout_batch.RolloutBatch`, its layout there),
and its split over data-parallel ranks and micro-batches.
"""
from __future__ import annotations

import torch

from mtrain.rollout.protocol import Completion
from mtrain.rollout.rollout_batch import RolloutBatch


def build_batch(completions: list[Completion], rewards: list[float], pad_id: int, pad_to_multiple: int = 1,
                routing=None) -> RolloutBatch:
    """routing: the model's `RoutingShape` when the run replays the engine's routing: every completion with output
    must carry its routed experts (checked here, before any trainer work), and the batch holds them.
    A completion is the two-segment trajectory (prompt, model turn): one batch builder, `trajectory.to_batch`."""
    if not completions:
        raise ValueError("build_batch: no completions")
    from mtrain.rollout.routing import held_rows
    from mtrain.rollout.trajectory import Segment, Trajectory, to_batch
    for c in completions:  # rows from position s > 0 belong after rows a caller held: merged there, never placed here
        if c.routed_experts is not None and c.routed_experts_start:
            raise ValueError(f"build_batch: completion {c.rid!r} carries routed experts from position "
                             f"{c.routed_experts_start} on, not a whole sample's; merge them into the sample's "
                             f"routing first (mtrain.rollout.routing.merge_resumed)")
    trajectories = [Trajectory(c.rid, [Segment("prompt", list(c.prompt_ids)),
                                       Segment("model", list(c.output_ids), list(c.logprobs), c.versions,
                                                       top_logprobs=c.top_logprobs)],
                               vision=c.vision, routed_experts=c.routed_experts,
                               routing_rows_received=held_rows(c.routed_experts) if c.routed_rows_received is None
                               else c.routed_rows_received) for c in completions]
    return to_batch(trajectories, pad_id, pad_to_multiple, rewards=rewards, routing=routing)


def dp_rows(seq_lens: torch.Tensor, dp_rank: int, dp_size: int, by_tokens: bool) -> torch.Tensor | slice:
    """This data-parallel rank's rows of a minibatch: equal counts (padded micro-batches), or equal token totals
    (packed micro-batches, train.max_tokens_per_micro_batch set: no rank waits for another's long samples)."""
    if by_tokens:
        from mtrain.trainer.packing import balanced_dp_rows
        return balanced_dp_rows(seq_lens, dp_rank, dp_size)
    return dp_slice(len(seq_lens), dp_rank, dp_size)


def dp_slice(n: int, dp_rank: int, dp_size: int) -> slice:
    if n % dp_size:
        raise ValueError(f"rollout batch of {n} samples does not split over {dp_size} data-parallel ranks")
    per = n // dp_size
    return slice(dp_rank * per, (dp_rank + 1) * per)
