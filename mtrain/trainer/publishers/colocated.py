"""Weight sync after each step: Megatron shards -> every engine's own parameter layout, all engines at once.

One plan per engine (built once: it depends only on the model, the two layouts and where the engine's ranks live);
every training rank runs every engine's executor, bucket by bucket, engines interleaved, so each rank sends the
slices other engines need while its own engine loads. Two modes (docs/design-resharding.md, docs/design-pool.md):
- pull: engine rank r of engine g is owned by the training rank on its GPU (`EngineGroups.owner`). That rank hands
  its engine rank CUDA IPC views of its own parameters plus persistent receive buffers for slices other ranks send,
  and a scatter table; the engine writes its parameters itself (`mtrain.reshard.pull`). For SGLang each owner
  serializes its rank's request and the group's leader sends them together; the reference engine (HF layout, one
  destination rank on its leader) pulls in-process.
- push: the leader assembles every engine rank's bucket and hands it to the engine (the fallback).
"""
from __future__ import annotations

import time
from itertools import zip_longest

import torch
import torch.distributed as dist

from mtrain.config import ConfigError
from mtrain.layouts.table import ModelLayout
from mtrain.reshard.executor import Executor
from mtrain.reshard.megatron_side import current_layout, tensor_lookup
from mtrain.reshard.placement import HFLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.reshard.pull import PullPlan
from mtrain.rollout.groups import EngineGroups


def engine_layout(kind: str, tp: int, ep: int = 1, fp8: bool = False, fp8_scaling: str = "block"):
    """fp8 (engine.weight_dtype=fp8): SGLang's FP8 layout (fp8_scaling: block or channel), quantized by the sync
    kernel; the HF-layout reference engine receives bf16 and emulates FP8 itself (mtrain.rollout.fp8_engine)."""
    return HFLayout() if kind == "hf" else SGLangLayout(tp=tp, ep=ep, fp8=fp8, fp8_scaling=fp8_scaling)


def sync_mode(mode: str) -> str:
    """Resolve sync.mode: every engine rank lives on the GPU of the training rank that owns it (engine groups), so
    pull applies to every engine and TP; push stays as the fallback."""
    if mode not in ("auto", "pull", "push"):
        raise ConfigError(f"sync.mode must be auto, pull or push, got {mode!r}")
    return "pull" if mode == "auto" else mode


class WeightSync:
    def __init__(self, model: ModelLayout, chunks, engine, *, groups: EngineGroups, engine_kind: str,
                 engine_ep: int = 1, dtype: torch.dtype, bucket_bytes: int, backend: str = "auto", device="cpu",
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None, mode: str = "pull",
                 engine_fp8: bool = False, fp8_scaling: str = "block"):
        """engine: this rank's engine (its group's leader) or None. engine_kind "hf": the reference engine's layout
        (one destination rank, written on the leader); "sglang": SGLang's, engine.tp ranks."""
        self.engine, self.groups, self.kind = engine, groups, engine_kind
        self.rank = dist.get_rank()
        self.mode = sync_mode(mode)
        self.my_group = groups.group_of(self.rank)
        self.is_leader = groups.is_leader(self.rank)
        dst_tp = 1 if engine_kind == "hf" else groups.tp
        self.dst_ranks = dst_tp
        src = current_layout(first_stage_layers, last_stage_layers)
        dst = engine_layout(engine_kind, groups.tp, engine_ep, engine_fp8, fp8_scaling)
        spread = self.mode == "pull" and engine_kind != "hf"
        self.executors, self.pulls = [], []
        lookup = tensor_lookup(chunks)
        for g in range(groups.count):
            owner = (lambda r, g=g: groups.owner(g, r)) if spread else (lambda r, g=g: groups.leader(g))
            plan = build_plan(model, src, dst, colocate=owner)
            ex = Executor(plan, self.rank, lookup, dtype=dtype, backend=backend, bucket_bytes=bucket_bytes,
                          device=device)
            self.executors.append(ex)
            self.pulls.append(PullPlan(ex) if self.mode == "pull" else None)
        # SGLang pull: each owner serializes its own engine rank's request; the group gathers them on its leader.
        self.spread = None
        if spread and groups.tp > 1:
            from mtrain.trainer.publishers.spread_pull import SpreadPull, engine_group_pgs
            pg = engine_group_pgs(groups)
            self.spread = SpreadPull(self.rank, groups.leader(self.my_group), groups.tp, pg, engine)

    def publish(self, version: int) -> dict[str, float]:
        """The WeightPublisher role (publishers/base.py)."""
        return self.sync(version=version)

    @torch.no_grad()
    def sync(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        n_bytes, error = 0, None
        # Every rank takes part in every bucket of every engine: an engine failure must not stop its leader's
        # loop early (the other ranks would wait forever). The first error is kept, then raised on all ranks.
        streams = [p.jobs() for p in self.pulls] if self.mode == "pull" else [ex.stream() for ex in self.executors]
        g = self.my_group
        last = (len(self.pulls[g].buckets) if self.mode == "pull" else len(self.executors[g].buckets)) - 1
        finished = False
        for i, per_engine in enumerate(zip_longest(*streams)):
            mine = per_engine[self.my_group]
            if mine is None:
                continue
            final = i == last
            try:
                if error is None:
                    if self.mode == "pull":
                        n_bytes += self._pull_bucket(mine, version if final else None)
                        finished = finished or final
                    elif self.is_leader:
                        rank_tensors = [mine.get(r, []) for r in range(self.dst_ranks)]
                        n_bytes += sum(t.numel() * t.element_size() for ts in rank_tensors for _, t in ts)
                        self.engine.update_weights(rank_tensors)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
        if error is None and self.is_leader and not finished:  # push, or a plan with nothing to write
            try:
                self.engine.finish_weight_update(version)
            except Exception as e:  # noqa: BLE001
                error = e
        agree_on_errors(error, self.rank, lambda r: f"rank {r} (engine {self.groups.group_of(r)})")
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(n_bytes)}

    def _pull_bucket(self, jobs: dict, version: int | None) -> int:
        """One bucket of this rank's engine in pull mode; returns the bytes the engine wrote for this rank."""
        if self.kind == "hf" or self.groups.tp == 1:
            if self.is_leader:
                self.engine.pull_weights([jobs.get(r) for r in range(self.dst_ranks)], version=version)
            return sum(j.nbytes for j in jobs.values())
        return self._pull_spread(jobs, version)

    def _pull_spread(self, jobs: dict, version: int | None) -> int:
        """SGLang at engine TP > 1: this rank owns engine rank `r` (its group rank); publishers/spread_pull.py."""
        return self.spread.bucket(jobs.get(self.spread.r), version)


def agree_on_errors(error: BaseException | None, rank: int, where=lambda r: f"rank {r}") -> None:
    """Every rank learns whether some rank's part of a sync failed (one all_gather_object): a failed rank raises its
    own error, the others an error naming the first failed rank (`where(rank)`), so no rank goes on alone."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (rank, f"{type(error).__name__}: {error}"))
    failed = [e for e in errors if e is not None]
    if failed:
        if error is not None:
            raise error
        r, msg = failed[0]
        raise RuntimeError(f"weight sync failed on {where(r)}: {msg}")
