"""One bucket of a pull sync into an SGLang engine of engine.tp > 1 whose engine ranks' sources live in other
processes: one process per engine rank, on that rank's GPU, holds what engine rank r reads (colocated: the training
rank on the GPU, its Megatron shards and receive buffers; separate: the engine rank on the GPU, its receive buffers
from the training ranks). Each serializes its own rank's request (CUDA IPC handles of tensors on its GPU, sources
and tables only when new to that rank), the group's leader sends all of them in one engine call
(`pull_weights_serialized`: SGLang's scheduler r runs the request on its GPU) and tells every owner whether the
engine took them, so each knows what its engine rank now holds.

Both placements run this same object (publishers/colocated.py `WeightSync`, publishers/separate.py `SeparateSync`):
they differ only in who owns engine rank r's sources, never in how a request reaches SGLang.
"""
from __future__ import annotations

import torch.distributed as dist


def engine_group_pgs(groups) -> object | None:
    """Every engine group's gloo group (a collective over the whole job: every rank creates every group, in the same
    order); returns this rank's, None where it is in no engine group."""
    mine, rank = None, dist.get_rank()
    for g in range(groups.count):
        ranks = list(groups.ranks(g))
        pg = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = pg
    return mine


class SpreadPull:
    """The owner of engine rank `rank - leader` of one SGLang engine of `tp` ranks; the leader holds the engine."""

    def __init__(self, rank: int, leader: int, tp: int, group_pg, engine=None):
        from mtrain.reshard.pull_protocol import PullSender
        self.rank, self.leader, self.tp, self.pg = rank, leader, tp, group_pg
        self.r = rank - leader
        if not 0 <= self.r < tp:
            raise ValueError(f"rank {rank} owns no engine rank of the engine led by rank {leader} (tp {tp})")
        if rank == leader and engine is None:
            raise ValueError(f"rank {rank} leads an engine of tp {tp} but holds none")
        self.engine = engine if rank == leader else None
        self.sender = PullSender(tp)

    def bucket(self, job, version: int | None) -> int:
        """Engine rank r's part of one bucket (`job`: its PullJob, None when the bucket has nothing for it); every
        rank of the group calls it for every bucket, in order. With `version` the engine also ends the sync. Returns
        the bytes written for this rank; raises the same error on every rank of the group when the engine fails."""
        from mtrain.rollout.sglang_loader import FINISH_NAME
        from mtrain.rollout.sglang_wire import _marker_tensor, serialize_bucket

        finish = version is not None
        try:  # a failure here must still reach the gather below, or the group would wait forever
            items = ([(FINISH_NAME, _marker_tensor())] if finish else []) if job is None else \
                self.sender.payload(self.r, job, finish, _marker_tensor())
            payload = serialize_bucket(items)
        except Exception as e:  # noqa: BLE001
            payload = RuntimeError(f"rank {self.rank} could not serialize engine rank {self.r}'s request: {e}")
        gathered = [None] * self.tp if self.engine is not None else None
        dist.gather_object(payload, gathered, dst=self.leader, group=self.pg)
        outcome = None
        if self.engine is not None:
            outcome = next((x for x in gathered if isinstance(x, Exception)), None)
            if outcome is None:
                try:
                    self.engine.pull_weights_serialized(gathered, version=version)
                except Exception as e:  # noqa: BLE001 - every owner must hear it
                    outcome = e
        box = [outcome]
        dist.broadcast_object_list(box, src=self.leader, group=self.pg)
        if box[0] is not None:
            self.sender.forget()
            raise box[0]
        if job is not None:
            self.sender.confirm(self.r, job)
        return job.nbytes if job is not None else 0
