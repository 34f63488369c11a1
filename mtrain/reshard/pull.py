"""Pull mode: the engine writes its parameters itself, reading the trainer's tensors in place.

Push mode (`Executor.stream`) packs every destination parameter into a bucket buffer that the engine's loader
then copies into its parameters: two passes over the bytes and one engine call per bucket. In pull mode the
process that owns an engine rank hands the engine, once, CUDA IPC views of the source tensors (its own
parameters, plus persistent receive buffers for slices other training ranks send) and, once per bucket, a
scatter table; each sync the engine's loader runs that table with one kernel launch per destination dtype,
straight from the trainer's memory into its own parameters (`mtrain.rollout.sglang_loader`). One pass over the
bytes; with no cross-process slices (the engine on the owner's GPU, training TP = PP = EP = 1 or every slice
local) one engine call per sync.

Requires every engine rank to live on the GPU of the process that owns it (its sources are read in place).
The executor's buckets then bound only the receive buffers; an owner that receives nothing gets one job.
"""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from mtrain.reshard.executor import Bucket, Executor, Key, piece_row
from mtrain.reshard.planner import Piece


@dataclass
class PullJob:
    """What one engine rank needs to write one bucket of its parameters itself.

    targets: the engine parameters written, (name, per-rank shape); rows: int64 [N, 8], a piece table row
    (`mtrain.kernels`) plus the target index, destination offsets counted from the target's first element and
    source indices into `sources`; sources: flat tensors read in place, the same storages every sync;
    table_key / sources_key: stable identities, so an engine that already holds them is sent neither again.
    """

    table_key: str
    targets: list[tuple[str, tuple[int, ...]]]
    rows: np.ndarray
    sources: list[torch.Tensor]
    sources_key: str
    nbytes: int  # bytes the engine writes (float32-only weights at 4, FP8 ones at 1 + their scales, the rest at the
    # sync dtype's size)
    quant: dict = field(default_factory=dict)  # target index -> layouts.fp8.Fp8Param: written as block FP8


def _key(p: Piece) -> Key:
    return (p.dst.rank, p.dst.chunk, p.dst.name)


class PullPlan:
    """Pull jobs of one executor's plan for the engine ranks this process owns (tables built once)."""

    def __init__(self, executor: Executor):
        self.ex = executor
        self.uid = uuid.uuid4().hex[:12]  # a new plan never reuses an engine's cached table
        moves = [executor.transfers(b) for b in executor.buckets]
        self.exchanges = any(send or recv for send, recv in moves)
        if self.exchanges:
            self.buckets = executor.buckets
        else:  # nothing to receive: the whole plan is one job per engine rank, no bucket bound needed
            self.buckets = [Bucket([k for b in executor.buckets for k in b.keys],
                                   [p for b in executor.buckets for p in b.pieces])]
        sizes: dict[tuple[int, bool], int] = {}
        for b, (_, recv) in zip(self.buckets, moves if self.exchanges else [({}, {})]):
            for peer, ps in recv.items():
                sizes[(peer, b.fp32)] = max(sizes.get((peer, b.fp32), 0), sum(p.numel for p in ps))
        self.recv_bufs = {k: torch.empty(n, dtype=torch.float32 if k[1] else executor.dtype, device=executor.device)
                          for k, n in sorted(sizes.items())}
        self.dst_ranks = sorted({k[0] for b in self.buckets for k in b.keys if executor.owner(k[0]) == executor.rank})
        self._tables: dict[tuple[int, int], tuple[list, np.ndarray, int, dict]] = {}
        self._src_cache: tuple | None = None

    def _recv_buffer(self, peer: int, numel: int, fp32: bool) -> torch.Tensor:
        return self.recv_bufs[(peer, fp32)][:numel]

    def sources(self, dst_rank: int) -> tuple[list[torch.Tensor], dict[Key, int], dict[tuple[int, bool], int]]:
        """Flat source tensors of one engine rank: its local sources (in place), then every receive buffer."""
        local = [p for b in self.buckets for p in b.pieces
                 if p.dst.rank == dst_rank and p.src is not None and self.ex.src_rank(p) == self.ex.rank]
        srcs, index = self.ex.local_sources(local, in_place=True)
        recv_index = {}
        for k, buf in self.recv_bufs.items():
            recv_index[k] = len(srcs)
            srcs.append(buf)
        return srcs, index, recv_index

    def _table(self, bi: int, dst_rank: int, index: dict[Key, int], recv_index: dict) -> tuple[list, np.ndarray, int, dict]:
        cached = self._tables.get((bi, dst_rank))
        if cached is not None:
            return cached
        bucket = self.buckets[bi]
        keys = [k for k in bucket.keys if k[0] == dst_rank]
        target_of = {k: i for i, k in enumerate(keys)}
        remote: dict[int, tuple[int, int]] = {}  # id(piece) -> (peer, element offset in its receive buffer)
        if self.exchanges:
            for peer, ps in self.ex.transfers(bucket)[1].items():
                off = 0
                for p in ps:
                    remote[id(p)] = (peer, off)
                    off += p.numel
        rows = []
        for p in bucket.pieces:
            if p.dst.rank != dst_rank:
                continue
            if p.src is None:
                row = piece_row(p, -1, None, None, 0)
            elif self.ex.src_rank(p) == self.ex.rank:
                row = piece_row(p, index[(p.src.rank, p.src.chunk, p.src.name)], None, None, 0)
            else:
                peer, off = remote[id(p)]
                row = piece_row(p, recv_index[(peer, bucket.fp32)], off, p.ncols, 0)
            rows.append(row + [target_of[_key(p)]])
        targets = [(k[2], self.ex.plan.dst_tensors[k].shape) for k in keys]
        quant = {i: self.ex.plan.quant[k] for i, k in enumerate(keys) if k in self.ex.plan.quant}
        nbytes = sum(int(np.prod(shape)) * (4 if k in self.ex.plan.fp32 else self.ex.dtype.itemsize)
                     for k, (_, shape) in zip(keys, targets) if k not in self.ex.plan.quant)
        nbytes += sum(int(np.prod(targets[i][1])) + 4 * int(np.prod(q.scale_shape)) for i, q in quant.items())
        out = self._tables[(bi, dst_rank)] = (targets, np.asarray(rows, dtype=np.int64).reshape(-1, 8), nbytes, quant)
        return out

    def jobs(self) -> Iterator[dict[int, PullJob]]:
        """Per bucket, {engine rank: PullJob} for the engine ranks this process owns (every training rank must
        iterate: the buckets' slices move between processes as they go). The jobs' sources are valid, and
        their contents final, until the next bucket is requested."""
        per_rank, skeys = self._current_sources()
        for bi, bucket in enumerate(self.buckets):
            if self.exchanges:
                self.ex.exchange(bucket, recv_buffer=self._recv_buffer)
            out = {}
            for r in self.dst_ranks:
                if not any(k[0] == r for k in bucket.keys):
                    continue
                srcs, index, recv_index = per_rank[r]
                targets, rows, nbytes, quant = self._table(bi, r, index, recv_index)
                out[r] = PullJob(f"{self.uid}/{bi}/{r}", targets, rows, srcs, skeys[r], nbytes, quant)
            if self.ex.device.type == "cuda":
                # Another process reads these tensors next: the optimizer's and the receives' writes must be done.
                torch.cuda.current_stream(self.ex.device).synchronize()
            yield out

    def _current_sources(self) -> tuple[dict, dict]:
        """Per engine rank: (sources, their index, receive-buffer index), and the source set's key.

        Looking up and checking thousands of parameters (a MoE model: one per expert and projection) costs
        tens of ms of Python per sync, so the result is kept and each sync only compares the parameters'
        current addresses with the kept ones: a parameter updated in place keeps its address; one given new
        memory (`param.data = ...`) does not, and then everything is looked up again. (The parameter objects
        themselves are fixed for the life of a WeightSync, which the trainer builds after the model.)"""
        if self._src_cache is not None:
            per_rank, skeys, params, ptrs = self._src_cache
            if [t.data_ptr() for t in params] == ptrs:
                return per_rank, skeys
        per_rank = {r: self.sources(r) for r in self.dst_ranks}
        skeys = {r: self._fingerprint(srcs) for r, (srcs, _, _) in per_rank.items()}
        keys = {k for _, index, _ in per_rank.values() for k in index}
        params = [self.ex.sources(self.ex.plan.src_tensors[k]) for k in sorted(keys)]
        self._src_cache = (per_rank, skeys, params, [t.data_ptr() for t in params])
        return per_rank, skeys

    def _fingerprint(self, srcs: list[torch.Tensor]) -> str:
        """Identity of the source set: changes when any source moves (a re-allocated parameter), so the engine
        is sent fresh IPC views then. An address cannot be reused for other data while the engine holds a view:
        torch keeps a block shared over CUDA IPC allocated until the receiver lets go of it."""
        meta = np.asarray([(t.data_ptr(), t.numel(), t.element_size()) for t in srcs], dtype=np.int64)
        return f"{self.uid}:{hashlib.sha1(meta.tobytes()).hexdigest()[:16]}"
