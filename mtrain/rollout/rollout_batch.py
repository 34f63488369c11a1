"""The trainer's padded batch: the tensors a rollout hands over (tokens, response mask, engine logprobs, rewards).

Layout: tokens[b] = prompt + response, right-padded to T. Position t of the model's output predicts token
t + 1, so every per-token tensor here ([B, T-1]: logprobs, masks, advantages) is indexed by the position of
the *predicting* token and `response_mask[b, t]` is 1 when token t + 1 is a response token.

`RolloutBatch.PER_TOKEN` names every per-token field (width T: per input token; width T - 1: per predicting
position); packing (mtrain/trainer/packing.py) carries each of them through, whatever its trailing dims. A new
per-token field (weight versions, routed experts) is added to the dataclass and to that tuple, nothing else.
Built from trajectories by `mtrain.rollout.trajectory.to_batch`; split over ranks by `mtrain.trainer.batch`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


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
    # score centering (algo.score_centering): [B, T-1, K] the engine's top-k token ids and their logprobs at each
    # predicting position of a model token (absent entries: id 0, logprob -inf); None when not recorded
    engine_head_ids: torch.Tensor | None = None
    engine_head_logprobs: torch.Tensor | None = None

    PER_TOKEN = ("tokens", "response_mask", "engine_logprobs", "versions", "routed_experts", "engine_head_ids",
                 "engine_head_logprobs")

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
