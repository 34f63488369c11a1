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


def engine_layout(kind: str, tp: int, ep: int = 1):
    return HFLayout() if kind == "hf" else SGLangLayout(tp=tp, ep=ep)


class WeightSync:
    def __init__(self, model: ModelLayout, chunks, engine, *, engine_kind: str, engine_tp: int = 1,
                 leader: int = 0, dtype: torch.dtype, bucket_bytes: int, backend: str = "auto", device="cpu"):
        self.engine, self.leader = engine, leader
        self.rank = dist.get_rank()
        self.plan = build_plan(model, current_layout(), engine_layout(engine_kind, engine_tp),
                               colocate=lambda r: leader)
        self.executor = Executor(self.plan, self.rank, tensor_lookup(chunks), dtype=dtype, backend=backend,
                                 bucket_bytes=bucket_bytes, device=device)
        self.tp = engine_tp

    @torch.no_grad()
    def sync(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        n_bytes = 0
        for bucket in self.executor.stream():
            if self.rank == self.leader:
                rank_tensors = [bucket.get(r, []) for r in range(self.tp)]
                n_bytes += sum(t.numel() * t.element_size() for ts in rank_tensors for _, t in ts)
                self.engine.update_weights(rank_tensors)
        if self.rank == self.leader:
            self.engine.finish_weight_update(version)
        dist.barrier()
        return {"time/sync": time.perf_counter() - t0, "sync/bytes": float(n_bytes)}
