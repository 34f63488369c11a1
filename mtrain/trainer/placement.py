"""The placement role: which ranks hold which role, and what sharing a GPU between them costs the loop.

Placement decides where roles live, never which features exist:

    colocated   every rank is a training rank and (its engine group's leader) hosts an engine; the engine gives its
                memory to training around the update (`EngineMemory`, engine.colocate)
    separate    the first ranks train (PolicyLearner), the last engine.ranks host engines (NoLearner); weights go
                point to point (publishers/separate.py)

The rank split itself is `mtrain.job_split.split_ranks` (checked in preflight, before any process group starts).
"""
from __future__ import annotations

import os
import time

import torch

from mtrain.job_split import JobSplit, split_ranks


class Placement:
    def __init__(self, cfg, world: int, rank: int):
        self.split: JobSplit = split_ranks(cfg, world)
        self.rank = rank

    @property
    def trains(self) -> bool:
        """This rank holds the learner (a Megatron model and its optimizer)."""
        return self.rank in self.split.train_ranks

    @property
    def separate(self) -> bool:
        return self.split.placement == "separate"


def is_engine_rank(cfg) -> bool:
    """Separate placement: this process (torchrun's RANK) is one of the last engine.ranks ranks (before any process
    group exists: Megatron is initialised over the training ranks only)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.engine.placement == "separate" and int(os.environ.get("RANK", "0")) >= world - cfg.engine.ranks


class EngineMemory:
    """Colocated engines give their memory to training and take it back (engine.colocate); a no-op elsewhere. The
    seconds it takes are summed per step into the metrics time/release_memory and time/resume_memory.
    weight_tags: () for a LoRA engine, which keeps its (frozen) base weights while training runs."""

    def __init__(self, engine, colocate: bool, weight_tags: tuple[str, ...]):
        self.engine = engine if colocate else None
        self.weight_tags = weight_tags
        self.seconds: dict[str, float] = {}
        self._released = False

    def release(self) -> None:
        self._released = True
        self._call("release_memory", ("kv_cache",) + self.weight_tags)

    def resume_weights(self) -> None:
        self._call("resume_memory", self.weight_tags)

    def resume_kv_cache(self) -> None:
        """After the publish: the KV cache comes back once the new weights are in (when it was given away)."""
        if self._released:
            self._released = False
            self._call("resume_memory", ("kv_cache",))

    def take_seconds(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

    def _call(self, op: str, tags: tuple[str, ...]) -> None:
        if self.engine is None or not tags:
            return
        t = time.perf_counter()
        if op == "resume_memory" and torch.cuda.is_initialized():
            # The caching allocator keeps the training step's activation blocks reserved: handed back first, or
            # the engine's weights and KV cache cannot come back (a Qwen3-4B shape on one H200 died here in
            # torch_memory_saver's resume, 2026-12-02)
            torch.cuda.empty_cache()
        getattr(self.engine, op)(tags)
        key = f"time/{op}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
