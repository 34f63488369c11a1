"""Weight sync of engine.placement=separate (`SeparateSync`, the `WeightSync` interface): the training ranks send each
engine rank the pieces of their shards it needs (mtrain/reshard/remote.py); on an engine rank (chunks=None) the same
object receives into its engine.

Who receives what: an engine's destination ranks are the first ranks of its group, as many as its layout has. The
reference engine (HF layout, one destination rank) receives everything on its leader at any engine.tp, its other
group ranks take no part; SGLang at engine.tp=k has k destination ranks, rank r of the group receives engine-TP shard
r into buffers on its own GPU, the GPU SGLang's scheduler r runs on (the leader starts all k schedulers from
base_gpu_id = its local rank, `SeparateGroups.sglang_placement`), and the group hands those buffers to SGLang exactly
as colocated owners do (publishers/spread_pull.py): each rank serializes its own rank's request, the leader sends
them in one engine call. With LoRA (publishers/lora.py) one SeparateSync carries the base (first sync) and a
second one the adapter table's rows, whole tensors at HF names (engine_kind="hf"), into the engine rank's
`AdapterTarget`, which loads them as the version's named adapter."""
from __future__ import annotations

import functools
import time

import torch

from mtrain.reshard.delta import DeltaExecutor, DeltaSender, delta_metrics
from mtrain.reshard.executor import Executor
from mtrain.reshard.placement import MegatronLayout
from mtrain.reshard.remote import EngineRanks, RemoteSync, RemoteSyncError, engine_plans
from mtrain.trainer.publishers.colocated import agree_on_errors, engine_layout


def training_layout(cfg, n_train: int) -> MegatronLayout:
    """The training ranks' Megatron layout, known to every rank without parallel_state (engine ranks have none)."""
    p = cfg.parallel
    return MegatronLayout(tp=p.tp, pp=p.pp, vpp=p.vpp if p.vpp and p.vpp > 1 else None, ep=p.ep, etp=p.etp or p.tp,
                          cp=p.cp, dp=n_train // (p.tp * p.pp * p.cp), first_stage_layers=p.first_stage_layers,
                          last_stage_layers=p.last_stage_layers)


def destination_ranks(groups, dst_tp: int) -> EngineRanks:
    """The global ranks that receive each engine's weights: the first `dst_tp` ranks of its group (rank r of the
    group receives destination rank r)."""
    return EngineRanks(tuple(tuple(groups.ranks(i)[:dst_tp]) for i in range(groups.count)))


class SeparateSync:
    """`sync(version)` on both sides of separate placement; the same interface as `WeightSync`."""

    def __init__(self, cfg, decisions, layout, rank: int, *, chunks=None, engine=None, dtype: torch.dtype,
                 engine_kind: str | None = None):
        """engine: on an engine rank, what `pull_weights(jobs, version)` writes into (the engine, or the LoRA
        AdapterTarget); engine_kind: the destination layout (default: the engine's own, decisions.engine_layout)."""
        from mtrain.reshard.megatron_side import tensor_lookup
        g = decisions.groups
        self.engine, self.rank = engine, rank
        kind = engine_kind or decisions.engine_layout
        dst_tp = 1 if kind == "hf" else g.tp
        self.engines = destination_ranks(g, dst_tp)
        dst = engine_layout(kind, dst_tp, cfg.engine.ep, decisions.engine_fp8, decisions.fp8_scaling)
        plans = engine_plans(layout, training_layout(cfg, g.first), dst, self.engines)
        executor, self.delta = Executor, None
        if cfg.sync.delta:  # only what changed travels (mtrain/reshard/delta.py, docs/design-delta-sync.md)
            self.delta = DeltaSender() if chunks is not None else None
            executor = functools.partial(DeltaExecutor, sender=self.delta)
        # SGLang at engine.tp > 1: every rank creates every engine group's gloo group (a whole-job collective)
        self.spread = None
        if dst_tp > 1:
            from mtrain.trainer.publishers.spread_pull import SpreadPull, engine_group_pgs
            pg = engine_group_pgs(g)
            if g.group_of(rank) is not None:
                self.spread = SpreadPull(rank, g.leader(g.group_of(rank)), dst_tp, pg, engine)
        # a rank neither training nor receiving (the reference engine's further group ranks) sends and receives nothing
        receives = self.engines.engine_of(rank) is not None
        self.remote = RemoteSync(plans, self.engines, rank, tensor_lookup(chunks) if chunks is not None else None,
                                 dtype=dtype, bucket_bytes=cfg.sync.bucket_mb << 20, backend=cfg.sync.backend,
                                 device=decisions.device, executor=executor) if chunks is not None or receives else None
        self.delta_on = cfg.sync.delta

    def publish(self, version: int) -> dict[str, float]:
        """The WeightPublisher role (publishers/base.py)."""
        return self.sync(version=version)

    @torch.no_grad()
    def sync(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        error, failed = None, []

        def write(job, final):  # the engine executes the bucket's table in its own layout
            if failed:  # keep receiving: the training ranks send every bucket whatever an engine did with the last
                return
            try:
                if self.spread is not None:  # SGLang at engine.tp > 1: through the group's leader
                    self.spread.bucket(job, version if final else None)
                else:
                    self.engine.pull_weights([job], version=version if final else None)
            except Exception as e:  # noqa: BLE001 - raised after the transfer, on every rank (below)
                failed.append(e)

        if self.delta is not None:
            self.delta.begin()
        try:
            out = self.remote.run(write) if self.remote is not None else {}
        except Exception as e:  # noqa: BLE001 - every rank must hear it (below), or the others wait forever
            error, out = e, {}
        error = error or (failed[0] if failed else None)
        # A transfer error (dead or hung peer) is raised where it happened: the peers' own transfers fail on their
        # own, and a gather with a dead rank would only add a second timeout.
        if isinstance(error, RemoteSyncError):
            raise error
        agree_on_errors(error, self.rank)
        if self.delta_on:
            out.update(delta_metrics(self.delta, self.remote.executors if self.remote is not None else []))
        out["time/sync"] = time.perf_counter() - t0
        return out
