"""A deterministic, resumable prompt sampler.

Each epoch is a permutation drawn from (seed, epoch), so the order never depends on how many batches were
drawn before a restart. A batch that crosses an epoch end takes the rest of this epoch and the start of the
next: every batch is full. `state_dict()` is the exact data position; loading it continues the same stream.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class SamplerStateError(ValueError):
    """A sampler state that does not belong to this dataset/seed."""


class PromptSampler:
    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"PromptSampler: num_samples must be >= 1, got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0  # next index into this epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> list[int]:
        """Indices of the next `batch_size` samples."""
        out: list[int] = []
        while len(out) < self.batch_size:
            take = min(self.batch_size - len(out), self.num_samples - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_samples:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_samples": self.num_samples, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("num_samples", "seed", "shuffle"):
            if state.get(k) != getattr(self, k):
                raise SamplerStateError(f"sampler state has {k}={state.get(k)!r} but this sampler has "
                                        f"{k}={getattr(self, k)!r}: resuming on different data or seed")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_samples:
            raise SamplerStateError(f"sampler state out of range: epoch={epoch}, position={position}, "
                                    f"num_samples={self.num_samples}")
        # batch_size may change on resume (a new prompts_per_step): the position is per sample, so it's fine.
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
