"""Weight sync after each step: Megatron shards -> the engine's own parameter layout, bucket by bucket.

The plan is built once (it depends only on the model and the two layouts). Every training rank runs the
executor; the engine's leader process assembles each bucket (it owns every destination rank) and hands it to
the engine. The engine's layout is SGLang's for the SGLang engine and HF's for the CPU reference engine.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mtrain.layouts.table import ModelLayout
from mtrain.reshard.executor import Executor
from mtrain.reshard.megatron_side import current_layout, tensor_lookup
from mtrain.reshard.placement import HFLayout, SGLangLayout
from mtrain.reshard.planner import build_plan
from mtrain.trainer.rollout_step import broadcast_result


def engine_layout(kind: str, tp: int, ep: int = 1):
    return HFLayout() if kind == "hf" else SGLangLayout(tp=tp, ep=ep)


class WeightSync:
    def __init__(self, model: ModelLayout, chunks, engine, *, engine_kind: str, engine_tp: int = 1, engine_ep: int = 1,
                 leader: int = 0, dtype: torch.dtype, bucket_bytes: int, backend: str = "auto", device="cpu",
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None):
        self.engine, self.leader = engine, leader
        self.rank = dist.get_rank()
        self.plan = build_plan(model, current_layout(first_stage_layers, last_stage_layers),
                               engine_layout(engine_kind, engine_tp, engine_ep), colocate=lambda r: leader)
        self.executor = Executor(self.plan, self.rank, tensor_lookup(chunks), dtype=dtype, backend=backend,
                                 bucket_bytes=bucket_bytes, device=device)
        self.tp = engine_tp

    @torch.no_grad()
    def sync(self, version: int) -> dict[str, float]:
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
