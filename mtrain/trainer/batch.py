"""Rollout results -> padded training tensors, and their split over data-parallel ranks and micro-batches.

Layout: tokens[b] = prompt + response, right-padded to T. Position t of the model's output predicts token
t + 1, so every per-token tensor here ([B, T-1]: logprobs, masks, advantages) is indexed by the position of
the *predicting* token and `response_mask[b, t]` is 1 when token t + 1 is a response token.

`RolloutBatch.PER_TOKEN` names every per-token field (width T: per input token; width T - 1: per predicting
position); packing (mtrain/trainer/packing.py) carries each of them through, whatever its trailing dims. A new
per-token field (weight versions, routed experts) is added to the dataclass and to that tuple, nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from mtrain.rollout.protocol import Completion


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, T-1] float
    engine_logprobs: torch.Tensor  # [B, T-1] float (0 off the mask)
    rewards: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] long: prompt + response tokens (the rest of the row is padding)
    versions: torch.Tensor  # [B, T-1] long: the weight version that generated each response token (-1 off the mask)
    # Vision models: each row's images (mtrain.data.vision.VisionRows: a VisionInputs or None per row); None when
    # no row has images. tokens[b] holds row b's expanded image tokens.
    vision: Any = None
    # routing replay: [B, T, layers, top_k] the engine's routed experts of every input token (mtrain/rollout/routing.py;
    # positions without a record hold RoutingShape.filler()); None when the run does not replay
    routed_experts: torch.Tensor | None = None

    PER_TOKEN = ("tokens", "response_mask", "engine_logprobs", "versions", "routed_experts")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def select(self, idx: slice | torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                               for f in fields(self)})

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Rows of several batches of the same width, in order (a step's minibatches, for its metrics)."""
        out = {f.name: None if getattr(batches[0], f.name) is None else torch.cat([getattr(b, f.name) for b in batches])
               for f in fields(RolloutBatch) if f.name != "vision"}
        return RolloutBatch(**out, vision=vision_rows_cat(batches))


def vision_rows_cat(batches: list["RolloutBatch"]):
    """The vision rows of several batches in order (text-only batches contribute None rows)."""
    if all(b.vision is None for b in batches):
        return None
    from mtrain.data.vision import VisionRows
    return VisionRows.cat([b.vision if b.vision is not None else VisionRows([None] * b.size) for b in batches])


def vision_rows(items: list) -> Any:
    """RolloutBatch.vision for per-row VisionInputs-or-None (None when no row has images)."""
    if all(v is None for v in items):
        return None
    from mtrain.data.vision import VisionRows
    return VisionRows(items)


def build_batch(completions: list[Completion], rewards: list[float], pad_id: int, pad_to_multiple: int = 1,
                routing=None) -> RolloutBatch:
    """routing: the model's `RoutingShape` when the run replays the engine's routing: every completion with output
    must carry its routed experts (checked here, before any trainer work), and the batch holds them.
    A completion is the two-segment trajectory (prompt, model turn): one batch builder, `trajectory.to_batch`."""
    if not completions:
        raise ValueError("build_batch: no completions")
    from mtrain.rollout.routing import held_rows
    from mtrain.rollout.trajectory import Segment, Trajectory, to_batch  # that module builds on this one
    for c in completions:  # rows from position s > 0 belong after rows a caller held: merged there, never placed here
        if c.routed_experts is not None and c.routed_experts_start:
            raise ValueError(f"build_batch: completion {c.rid!r} carries routed experts from position "
                             f"{c.routed_experts_start} on, not a whole sample's; merge them into the sample's "
                             f"routing first (mtrain.rollout.routing.merge_resumed)")
    trajectories = [Trajectory(c.rid, [Segment("prompt", list(c.prompt_ids)),
                                       Segment("model", list(c.output_ids), list(c.logprobs), c.versions)],
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
