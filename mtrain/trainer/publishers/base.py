"""The weight-publisher role: after update N the engines get weights N behind one call, `publish(N)`.

Implementations: `WeightSync` (publishers/colocated.py: engines on the training ranks pull bucket by bucket),
`AdapterSync` (publishers/lora.py: the base once, then a named LoRA adapter per version), `SeparateSync`
(publishers/separate.py: point-to-point to engines on ranks of their own; its engine-rank side receives). FP8
engines are a destination layout of the first two. Every rank of the job calls `publish` in the same step.
"""
from __future__ import annotations

from typing import Protocol


class WeightPublisher(Protocol):
    def publish(self, version: int) -> dict[str, float]:
        """Send the trainer's weights as `version`; returns the step's sync metrics (time/sync, ...)."""
        ...
