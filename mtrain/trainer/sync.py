"""Weight sync after each step: Megatron shards -> the engine's own parameter layout, bucket by bucket.

The plan is built once (it depends only on the model and the two layouts). Every training rank runs the
executor; the engine's leader process owns every destination rank. Two modes (docs/design-resharding.md):
push -- the leader assembles each bucket and hands it to the engine, whose loader copies it in; pull -- the
leader hands the engine views of its own tensors (and of what other ranks sent it) and a table, and the engine
writes its parameters itself (`mtrain.reshard.pull`). The engine's layout is SGLang's for the SGLang engine and
HF's for the CPU reference engine.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mtrain.config import ConfigError
from mtrain.layouts.table import ModelLayout
from mtrain.reshard.executor import Executor
from mtrain.reshard.megatron_side import current_layout, tensor_lookup
from mtrain.reshard.placement import HFLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.reshard.pull import PullPlan
from mtrain.trainer.rollout_step import broadcast_result


def engine_layout(kind: str, tp: int, ep: int = 1, fp8: bool = False):
    """fp8 (engine.weight_dtype=fp8): SGLang's block-FP8 layout, quantized by the sync kernel; the HF-layout
    reference engine receives bf16 and emulates FP8 itself (mtrain.rollout.fp8_engine)."""
    return HFLayout() if kind == "hf" else SGLangLayout(tp=tp, ep=ep, fp8=fp8)


def sync_mode(mode: str, engine_kind: str, engine_tp: int) -> str:
    """Resolve sync.mode: pull needs every engine rank on the GPU of the process that owns it, and the leader owns
    every engine rank, so pull means engine TP 1 (both engines implement it; the reference engine in-process)."""
    if mode not in ("auto", "pull", "push"):
        raise ConfigError(f"sync.mode must be auto, pull or push, got {mode!r}")
    if mode == "auto":
        return "pull" if engine_tp == 1 else "push"
    if mode == "pull" and engine_tp != 1:
        raise ConfigError(f"sync.mode: pull needs engine.tp=1 (the {engine_kind} engine here has tp={engine_tp}); "
                          "use push or auto")
    return mode


class WeightSync:
    def __init__(self, model: ModelLayout, chunks, engine, *, engine_kind: str, engine_tp: int = 1, engine_ep: int = 1,
                 leader: int = 0, dtype: torch.dtype, bucket_bytes: int, backend: str = "auto", device="cpu",
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None, mode: str = "push",
                 engine_fp8: bool = False):
        self.engine, self.leader = engine, leader
        self.rank = dist.get_rank()
        self.plan = build_plan(model, current_layout(first_stage_layers, last_stage_layers),
                               engine_layout(engine_kind, engine_tp, engine_ep, engine_fp8), colocate=lambda r: leader)
        self.executor = Executor(self.plan, self.rank, tensor_lookup(chunks), dtype=dtype, backend=backend,
                                 bucket_bytes=bucket_bytes, device=device)
        self.tp = engine_tp
        self.mode = sync_mode(mode, engine_kind, engine_tp)
        self.pull = PullPlan(self.executor) if self.mode == "pull" else None

    @torch.no_grad()
    def sync(self, version: int) -> dict[str, float]:
        if self.pull is not None:
            return self._sync_pull(version)
        t0 = time.perf_counter()
        n_bytes = 0
        error = None
        # Every rank takes part in every bucket's collectives: an engine failure on the leader must not stop its
        # loop early (the other ranks would wait forever). The first error is kept, then shipped to all ranks.
        for bucket in self.executor.stream():
            if self.rank == self.leader and error is None:
                rank_tensors = [bucket.get(r, []) for r in range(self.tp)]
                n_bytes += sum(t.numel() * t.element_size() for ts in rank_tensors for _, t in ts)
                try:
                    self.engine.update_weights(rank_tensors)
                except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                    error = e
        if self.rank == self.leader and error is None:
            try:
                self.engine.finish_weight_update(version)
            except Exception as e:  # noqa: BLE001
                error = e
        broadcast_result(error, self.leader)  # raises the leader's error everywhere; else a barrier
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(n_bytes)}

    def _sync_pull(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        n_bytes = 0
        error, finished = None, False
        last = len(self.pull.buckets) - 1
        # The last engine call also finishes the sync. No look-ahead: requesting the next bucket would overwrite
        # the receive buffers the engine is about to read.
        for i, jobs in enumerate(self.pull.jobs()):
            if self.rank == self.leader and error is None:
                n_bytes += sum(j.nbytes for j in jobs.values())
                try:
                    self.engine.pull_weights([jobs.get(r) for r in range(self.tp)], version=version if i == last else None)
                    finished = i == last
                except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                    error = e
        if self.rank == self.leader and error is None and not finished:  # a plan with nothing to write
            try:
                self.engine.finish_weight_update(version)
            except Exception as e:  # noqa: BLE001
                error = e
        broadcast_result(error, self.leader)
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(n_bytes)}
