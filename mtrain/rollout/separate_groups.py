"""Engine groups of separate placement (engine.placement=separate): engines only on the job's last ranks.

The same questions as `EngineGroups` (which rank leads which engine, who starts it, where its ranks are), answered
for a job whose first `first` ranks train and host nothing, and whose remaining ranks are cut into engines of
`engine.tp` consecutive ranks. Training ranks lead no engine: in the rollout pool they only submit and gather.
Pure arithmetic, the same answer on every rank (mtrain/job_split.py decides the split).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtrain.rollout.groups import EngineLayoutError


@dataclass(frozen=True)
class SeparateGroups:
    world_size: int
    first: int  # the first engine rank = the number of training ranks
    tp: int
    local_world_size: int
    nnodes: int = 1

    def __post_init__(self) -> None:
        n = self.world_size - self.first
        if self.first < 1 or n < self.tp or n % self.tp:
            raise EngineLayoutError(f"{n} engine ranks after {self.first} training ranks do not split into engines "
                                    f"of engine.tp={self.tp}")

    @property
    def count(self) -> int:
        return (self.world_size - self.first) // self.tp

    def group_of(self, rank: int) -> int | None:
        """The engine a rank hosts a part of; None for a training rank."""
        return None if rank < self.first else (rank - self.first) // self.tp

    def leader(self, group: int) -> int:
        return self.first + group * self.tp

    def ranks(self, group: int) -> list[int]:
        return list(range(self.leader(group), self.leader(group) + self.tp))

    def owner(self, group: int, engine_rank: int) -> int:
        """The global rank that hosts engine rank `engine_rank` of engine `group` (and receives its weights)."""
        return self.leader(group) + engine_rank

    def is_leader(self, rank: int) -> bool:
        return rank >= self.first and (rank - self.first) % self.tp == 0

    def node_rank(self, rank: int) -> int:
        return 0

    def straddling(self) -> int | None:
        """The first engine whose ranks lie on two nodes (torchrun numbers ranks node by node, local_world_size per
        node), None when every engine fits one node. An SGLang engine of engine.tp > 1 must fit one: its leader
        starts all its schedulers on its own node's GPUs local_rank .. local_rank + tp - 1 (`sglang_placement`),
        the GPUs of its group's ranks, where each rank receives its shard."""
        for g in range(self.count):
            ranks = self.ranks(g)
            if ranks[0] // self.local_world_size != ranks[-1] // self.local_world_size:
                return g
        return None

    def starts_engine_part(self, rank: int) -> bool:
        return self.is_leader(rank)

    def sglang_placement(self, rank: int, *, local_rank: int, dist_init_addr: str | None = None) -> dict[str, Any]:
        if not self.is_leader(rank):
            raise EngineLayoutError(f"rank {rank} starts no engine (training ranks host none; an engine's leader "
                                    "starts it)")
        return {"tp_size": self.tp, "base_gpu_id": local_rank}

    def describe(self) -> str:
        return (f"engines: {self.count} on ranks {self.first}-{self.world_size - 1} (engine.tp {self.tp}), leaders at "
                f"ranks {[self.leader(g) for g in range(min(self.count, 8))]}{' ...' if self.count > 8 else ''}; "
                f"ranks 0-{self.first - 1} train")
