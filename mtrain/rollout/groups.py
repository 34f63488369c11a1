"""Engine groups: how the job's ranks are partitioned into rollout engines.

Ranks are cut into groups of `engine.tp` consecutive ranks; group g's first rank (its leader) owns engine g, and
engine TP rank r lives on the GPU of group rank r, so that pull-mode sync reads that GPU's training shards in
place. An engine may span nodes (`engine.nnodes` > 1): then a group is `nnodes` whole nodes, and the first
group rank on each node starts that node's share of the engine (SGLang's `nnodes`/`node_rank`/`dist_init_addr`,
docs/design-pool.md). This module is pure arithmetic: every rank computes the same answer from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class EngineLayoutError(ValueError):
    """The job's ranks do not split into the engine groups the config asks for; the message says how to fix it."""


@dataclass(frozen=True)
class EngineGroups:
    world_size: int
    tp: int  # engine TP degree = ranks per group
    local_world_size: int  # ranks per node (torchrun's LOCAL_WORLD_SIZE)
    nnodes: int = 1  # nodes one engine spans

    def __post_init__(self) -> None:
        w, tp, local, nn = self.world_size, self.tp, self.local_world_size, self.nnodes
        for name, v in (("world size", w), ("engine.tp", tp), ("ranks per node", local), ("engine.nnodes", nn)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineLayoutError(f"{name} must be an int >= 1, got {v!r}")
        if w % tp:
            raise EngineLayoutError(f"engine.tp={tp} does not divide the {w} ranks of the job into engine groups")
        if w % local:
            raise EngineLayoutError(f"{w} ranks do not split into nodes of {local} ranks")
        if nn == 1:
            if local % tp:
                raise EngineLayoutError(f"engine.tp={tp} does not divide the {local} ranks of a node: an engine "
                                        f"would straddle two nodes; set engine.nnodes to span whole nodes")
        elif tp != nn * local:
            raise EngineLayoutError(f"engine.nnodes={nn} spans {nn} whole nodes of {local} ranks, so engine.tp must "
                                    f"be {nn * local}, got {tp}")
        if nn > 1 and (w // local) % nn:
            raise EngineLayoutError(f"engine.nnodes={nn} does not divide the job's {w // local} nodes")

    @property
    def count(self) -> int:
        return self.world_size // self.tp

    def group_of(self, rank: int) -> int:
        return rank // self.tp

    def leader(self, group: int) -> int:
        return group * self.tp

    def ranks(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def owner(self, group: int, engine_rank: int) -> int:
        """The training rank on whose GPU engine rank `engine_rank` of engine `group` lives."""
        return group * self.tp + engine_rank

    def is_leader(self, rank: int) -> bool:
        return rank % self.tp == 0

    def node_rank(self, rank: int) -> int:
        """For an engine spanning nodes: which of its nodes `rank` is on (0 for the leader's node)."""
        return (rank - self.leader(self.group_of(rank))) // self.local_world_size

    def starts_engine_part(self, rank: int) -> bool:
        """This rank creates an SGLang Engine object: the leader, and with nnodes > 1 the first group rank of each
        further node (its schedulers serve that node's engine ranks; only the leader's takes requests)."""
        return (rank - self.leader(self.group_of(rank))) % self.local_world_size == 0

    def sglang_placement(self, rank: int, *, local_rank: int, dist_init_addr: str | None = None) -> dict[str, Any]:
        """SGLang server arguments that place the engine part started by `rank` (see starts_engine_part)."""
        if not self.starts_engine_part(rank):
            raise EngineLayoutError(f"rank {rank} starts no engine part (its group's leader does)")
        args: dict[str, Any] = {"tp_size": self.tp, "base_gpu_id": local_rank}
        if self.nnodes > 1:
            if not dist_init_addr:
                raise EngineLayoutError(f"an engine spanning engine.nnodes={self.nnodes} nodes needs a rendezvous "
                                        "address (host:port of the group leader's node)")
            args.update(nnodes=self.nnodes, node_rank=self.node_rank(rank), dist_init_addr=dist_init_addr)
        return args

    def describe(self) -> str:
        per = f"{self.tp} rank{'s' if self.tp > 1 else ''}" + (f" over {self.nnodes} nodes" if self.nnodes > 1 else "")
        return (f"engines: {self.count} (engine.count = {self.world_size} ranks / engine.tp {self.tp}), {per} each, "
                f"leaders at ranks {[self.leader(g) for g in range(min(self.count, 8))]}"
                f"{' ...' if self.count > 8 else ''}")
