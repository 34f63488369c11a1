"""Shard-to-shard weight sync into engines that live on other ranks (engine.placement=separate).

The training ranks (global ranks 0..T-1, Megatron's layout over them) hold the sources; each engine rank (a
global rank >= T) owns one destination rank of one engine. One plan per engine (`build_plan` with the engine's
global ranks as the owners of its destination ranks), so each training rank knows exactly which rectangles of its
own shards each engine rank needs. Per bucket a training rank packs, per engine rank, the pieces it holds into one
buffer and sends it (one `batch_isend_irecv` per engine and bucket: gloo on CPU, NCCL on GPU, the same code); the
engine rank receives one buffer per training rank that holds a piece of that bucket into persistent receive buffers
and its engine then scatters them into its own parameters with the pull protocol's table
(`mtrain.reshard.pull.PullJob`): the same engine-side code as the colocated pull sync (`pull_protocol.run_pull`,
inside SGLang's scheduler or the reference engine), FP8 destinations block-quantized there, in the scatter kernel
(the receiving side). Nothing is assembled into full HF-named tensors; no rank ever holds more than its own shards
plus one bucket's slices.

Failure: a peer that died closes its connection (gloo raises at once; NCCL's watchdog ends the process) and one that
hangs runs into the default group's timeout (`train.collective_timeout_s`); either way the error names the engine
and its ranks (`RemoteSyncError`), never a silent hang in a weight transfer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import zip_longest
from typing import Callable

import torch

from mtrain.layouts.table import ModelLayout
from mtrain.reshard.executor import Executor
from mtrain.reshard.planner import Plan, TensorRef, build_plan
from mtrain.reshard.pull import PullJob, PullPlan


class RemoteSyncError(RuntimeError):
    """A weight transfer between training and engine ranks failed; the message names the engine and its ranks."""


@dataclass(frozen=True)
class EngineRanks:
    """The global ranks of each engine: engines[g][r] hosts destination rank r of engine g."""

    engines: tuple[tuple[int, ...], ...]

    @classmethod
    def after(cls, first: int, count: int, tp: int) -> "EngineRanks":
        """`count` engine ranks from global rank `first` on, `tp` consecutive ranks per engine."""
        return cls(tuple(tuple(range(first + g * tp, first + (g + 1) * tp)) for g in range(count // tp)))

    def engine_of(self, rank: int) -> tuple[int, int] | None:
        """(engine, destination rank) of a global rank, None for a training rank."""
        for g, ranks in enumerate(self.engines):
            if rank in ranks:
                return g, ranks.index(rank)
        return None

    def describe(self, g: int) -> str:
        ranks = self.engines[g]
        return f"engine {g} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def engine_plans(model: ModelLayout, src_layout, dst_layout, engines: EngineRanks) -> list[Plan]:
    """One plan per engine; its destination rank r is written by global rank engines[g][r]. Training ranks must be
    global ranks 0..src_layout.world-1 (job_split puts them first)."""
    first = min(r for ranks in engines.engines for r in ranks)
    if first < src_layout.world:
        raise ValueError(f"engine ranks start at {first}, inside the {src_layout.world} training ranks")
    if any(len(ranks) != dst_layout.world for ranks in engines.engines):
        raise ValueError(f"every engine needs {dst_layout.world} ranks (its layout's world), got {engines.engines}")
    return [build_plan(model, src_layout, dst_layout, colocate=lambda r, g=g: engines.engines[g][r])
            for g in range(len(engines.engines))]


class RemoteSync:
    """Both ends of the remote sync, one object per process.

    Training rank: `sources` looks up this rank's Megatron tensors; `run()` sends every engine its slices, bucket by
    bucket, engines interleaved. Engine rank: `run(write)` receives its own engine rank's slices and calls
    `write(job, final)` once per bucket with the bucket's `PullJob` (sources = the receive buffers), which the
    engine executes in its own layout; `final` marks the last bucket (the place to finish the version).
    """

    def __init__(self, plans: list[Plan], engines: EngineRanks, rank: int,
                 sources: Callable[[TensorRef], torch.Tensor] | None = None, *, dtype: torch.dtype,
                 bucket_bytes: int, backend: str = "auto", device="cpu", group=None, executor=Executor):
        """`executor`: the Executor class or a factory with its signature (mtrain/reshard/delta.py: sync.delta)."""
        self.engines, self.rank = engines, rank
        self.where = engines.engine_of(rank)
        lookup = sources or self._no_sources
        if self.where is None:
            self.executors = [executor(p, rank, lookup, dtype=dtype, bucket_bytes=bucket_bytes, backend=backend,
                                       device=device, group=group) for p in plans]
            self.pull = None
        else:
            g, _ = self.where
            ex = executor(plans[g], rank, lookup, dtype=dtype, bucket_bytes=bucket_bytes, backend=backend,
                          device=device, group=group)
            self.executors = [ex]
            self.pull = PullPlan(ex)  # persistent receive buffers + tables built once

    def _no_sources(self, ref: TensorRef) -> torch.Tensor:
        raise RuntimeError(f"rank {self.rank} is an engine rank: it holds no training tensor ({ref.name})")

    @torch.no_grad()
    def run(self, write: Callable[[PullJob | None, bool], None] | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        moved = 0
        if self.where is None:
            per_engine = [ex.buckets for ex in self.executors]
            for step in zip_longest(*per_engine):
                for g, bucket in enumerate(step):
                    if bucket is None:
                        continue
                    send, _ = self.executors[g].transfers(bucket)
                    moved += sum(p.numel for ps in send.values() for p in ps) * self.executors[g]._dtype(bucket).itemsize
                    self._guard(g, lambda: self.executors[g].exchange(bucket))
        else:
            g, r = self.where
            n = len(self.pull.buckets)
            jobs = self.pull.jobs()
            for i in range(n):
                got = self._guard(g, lambda: next(jobs))
                job = got.get(r)
                moved += job.nbytes if job is not None else 0
                write(job, i == n - 1)
        return {"time/sync_remote": time.perf_counter() - t0, "sync/bytes": float(moved)}

    def _guard(self, g: int, fn):
        """Run one bucket's transfer; a dead or hung peer becomes an error that names the engine."""
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError)
            side = "training rank" if self.where is None else "engine rank"
            raise RemoteSyncError(f"weight transfer between the training ranks and {self.engines.describe(g)} "
                                  f"failed on {side} {self.rank} (a peer died or hung past "
                                  f"train.collective_timeout_s; {'; '.join(getattr(e, '__notes__', []))}): "
                                  f"{type(e).__name__}: {str(e)[:300]}") from e
