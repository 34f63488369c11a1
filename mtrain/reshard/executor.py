"""Runs a resharding `Plan` on the ranks of a job, bucket by bucket, with bounded memory.

Per bucket every process: packs the pieces other processes need from its tensors into one buffer per peer
and sends it; receives what it needs; then writes every destination tensor it owns with one kernel call
per destination buffer (`mtrain.kernels.execute_pieces`), taking sources from its own tensors and the
received buffers. Only the slices a destination needs ever move. Buckets hold whole destination
parameters, so a bucket is at most max(bucket_bytes, the largest single parameter) per destination rank.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from mtrain.kernels import PieceTable, execute_pieces
from mtrain.reshard.planner import Piece, Plan, TensorRef

Key = tuple[int, int, str]  # (rank, chunk, name)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _geom(ref: TensorRef, slot: int | None) -> tuple[int, int]:
    """(element offset of the slot, row length) of a parameter seen as [slots,] rows x cols."""
    shape = ref.shape[1:] if slot is not None else ref.shape
    cols = _numel(shape[1:])  # 1 for a vector; in*t*h*w for a conv kernel (a replicated whole tensor)
    rows = shape[0]
    return (slot or 0) * rows * cols, cols


def _src_start(p: Piece) -> tuple[int, int]:
    """(element offset, row length) of a piece's first source element in its source parameter."""
    slot_off, cols = _geom(p.src, p.src_slot)
    return slot_off + p.src_row * cols + p.src_col, cols


def piece_row(p: Piece, src_index: int, src_base: int | None, src_stride: int | None, dst_base: int) -> list[int]:
    """One kernel table row. src_base/src_stride override the source geometry (a packed receive buffer)."""
    d_off, d_cols = _geom(p.dst, p.dst_slot)
    nrows, ncols = p.nrows, p.ncols
    if p.src is None:
        s_off, s_stride = 0, ncols
    elif src_base is not None:
        s_off, s_stride = src_base, src_stride
    else:
        s_off, s_stride = _src_start(p)
    d = dst_base + d_off + p.dst_row * d_cols + p.dst_col
    if ncols == s_stride == d_cols:  # whole rows on both sides: one contiguous run
        ncols, nrows, s_stride, d_stride = nrows * ncols, 1, nrows * ncols, nrows * ncols
    else:
        d_stride = d_cols
    return [src_index if p.src is not None else -1, s_off, s_stride, d, d_stride, nrows, ncols]


@dataclass
class Bucket:
    keys: list[Key]  # destination tensors, all ranks
    pieces: list[Piece]
    fp32: bool = False  # a bucket of weights that stay float32 (plan.fp32)


def make_buckets(plan: Plan, bucket_bytes: int, itemsize: int) -> list[Bucket]:
    """Group destination tensors (same name on all ranks together) in plan order into bounded buckets;
    float32-only weights (plan.fp32) go into buckets of their own, after the others."""
    plain = _buckets(plan, [p for p in plan.pieces if (p.dst.rank, p.dst.chunk, p.dst.name) not in plan.fp32],
                     bucket_bytes, itemsize)
    wide = _buckets(plan, [p for p in plan.pieces if (p.dst.rank, p.dst.chunk, p.dst.name) in plan.fp32],
                    bucket_bytes, 4)
    for b in wide:
        b.fp32 = True
    return plain + wide


def _buckets(plan: Plan, pieces: list[Piece], bucket_bytes: int, itemsize: int) -> list[Bucket]:
    by_dst: dict[Key, list[Piece]] = defaultdict(list)
    order: list[str] = []
    names: dict[str, list[Key]] = defaultdict(list)
    for p in pieces:
        k = (p.dst.rank, p.dst.chunk, p.dst.name)
        if k not in by_dst:
            if (p.dst.chunk, p.dst.name) not in names:
                order.append((p.dst.chunk, p.dst.name))
            names[(p.dst.chunk, p.dst.name)].append(k)
        by_dst[k].append(p)
    buckets, cur, cur_bytes = [], [], defaultdict(int)
    for cn in order:
        keys = names[cn]
        add = {k[0]: _numel(plan.dst_tensors[k].shape) * itemsize for k in keys}
        if cur and any(cur_bytes[r] + b > bucket_bytes for r, b in add.items()):
            buckets.append(cur)
            cur, cur_bytes = [], defaultdict(int)
        cur.extend(keys)
        for r, b in add.items():
            cur_bytes[r] += b
    if cur:
        buckets.append(cur)
    return [Bucket(keys, [p for k in keys for p in by_dst[k]]) for keys in buckets]


class Executor:
    """Executes a plan on this process.

    rank: this process's rank in `group` (the training ranks); sources(ref) -> the tensor `ref` names (a
    TensorRef: rank, chunk, name; in a live job always one of this rank's own);
    src_everywhere: every process can read every source itself (an HF checkpoint on a shared disk), so
    nothing is sent.
    """

    def __init__(self, plan: Plan, rank: int, sources: Callable[[TensorRef], torch.Tensor], *,
                 bucket_bytes: int = 512 << 20, dtype: torch.dtype = torch.bfloat16, group=None,
                 src_everywhere: bool = False, backend: str = "auto", device: str | torch.device = "cpu"):
        self.plan, self.rank, self.sources = plan, rank, sources
        self.dtype, self.group, self.everywhere, self.backend = dtype, group, src_everywhere, backend
        self.device = torch.device(device)
        self.buckets = make_buckets(plan, bucket_bytes, torch.empty((), dtype=dtype).element_size())
        self._tables: dict = {}
        self._bufs: dict[tuple[int, bool], torch.Tensor] = {}
        self._moves: dict[int, tuple[Bucket, dict, dict]] = {}  # id(bucket) -> (bucket, send, recv)

    def owner(self, dst_rank: int) -> int:
        return self.plan.owner.get(dst_rank, dst_rank)

    def src_rank(self, p: Piece) -> int:
        return self.owner(p.dst.rank) if self.everywhere else p.src.rank

    def _dtype(self, bucket: Bucket) -> torch.dtype:
        return torch.float32 if bucket.fp32 else self.dtype

    def transfers(self, bucket: Bucket) -> tuple[dict[int, list[Piece]], dict[int, list[Piece]]]:
        """(pieces I send, per peer; pieces I receive, per peer), each list in bucket order: a receive buffer
        holds its peer's pieces packed back to back in that order. Depends on the plan only: computed once per
        bucket (the bucket is kept with the result, so its id cannot be reused while cached)."""
        hit = self._moves.get(id(bucket))
        if hit is not None:
            return hit[1], hit[2]
        send: dict[int, list[Piece]] = defaultdict(list)
        recv: dict[int, list[Piece]] = defaultdict(list)
        for p in bucket.pieces:
            if p.src is None:
                continue
            s, o = self.src_rank(p), self.owner(p.dst.rank)
            if s == o:
                continue
            if s == self.rank:
                send[o].append(p)
            elif o == self.rank:
                recv[s].append(p)
        self._moves[id(bucket)] = (bucket, send, recv)
        return send, recv

    def exchange(self, bucket: Bucket, recv_buffer: Callable[[int, int, bool], torch.Tensor] | None = None
                  ) -> dict[int, tuple[torch.Tensor, list[Piece]]]:
        """Send my pieces that others own; return per peer (received buffer, its pieces in order).
        recv_buffer(peer, numel, fp32) supplies the receive buffers (default: fresh ones)."""
        send, recv = self.transfers(bucket)
        # One batch_isend_irecv, not single isend/irecv: NCCL with an eagerly initialised default group (device_id
        # set) serialises unbatched P2P ops on a group, so two ranks that each send to the other first deadlock
        # (2 x H200, 2026-11-30: training PP2 -> engine TP2, both ranks stuck after NCCL's "unbatched P2P" warning).
        ops, out, keep = [], {}, []
        for peer in sorted(send):
            ps = send[peer]
            buf = torch.empty(sum(p.numel for p in ps), dtype=self._dtype(bucket), device=self.device)
            self._pack(buf, ps, cache_key=("pack", id(bucket), peer))
            keep.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, peer, group=self.group))
        for peer in sorted(recv):
            ps = recv[peer]
            n = sum(p.numel for p in ps)
            buf = (torch.empty(n, dtype=self._dtype(bucket), device=self.device) if recv_buffer is None
                   else recv_buffer(peer, n, bucket.fp32))
            out[peer] = (buf, ps)
            ops.append(dist.P2POp(dist.irecv, buf, peer, group=self.group))
        peers = [op.peer for op in ops]
        works = dist.batch_isend_irecv(ops) if ops else []
        for i, work in enumerate(works):
            try:
                work.wait()
            except Exception as e:  # a dead or hung peer: say which one (gloo has one work per op, NCCL one per batch)
                e.add_note(f"peer rank {peers[i]}" if len(works) == len(ops) else f"peer ranks {sorted(set(peers))}")
                raise
        return out

    def local_sources(self, pieces: list[Piece], in_place: bool = False) -> tuple[list[torch.Tensor], dict[Key, int]]:
        """This rank's source tensors the pieces read, flat, and their index by key. in_place: the tensors must
        be the parameters' own memory (another process reads them later), so a non-contiguous one is an error
        rather than a copy."""
        srcs, index = [], {}
        for p in pieces:
            k = (p.src.rank, p.src.chunk, p.src.name)
            if k not in index:
                t = self.sources(p.src)
                if tuple(t.shape) != p.src.shape:
                    raise ValueError(f"source {p.src.name} on rank {self.rank} has shape {tuple(t.shape)}, "
                                     f"the layout table expects {p.src.shape}")
                if in_place and not t.is_contiguous():
                    raise ValueError(f"source {p.src.name} on rank {self.rank} is not contiguous: the engine "
                                     "cannot read it in place")
                index[k] = len(srcs)
                srcs.append(t.contiguous().view(-1))
        return srcs, index

    def _pack(self, buf: torch.Tensor, pieces: list[Piece], cache_key) -> None:
        srcs, index = self.local_sources(pieces)
        table = self._tables.get(cache_key)
        if table is None:
            rows, off = [], 0
            for p in pieces:
                s, s_cols = _src_start(p)
                rows.append([index[(p.src.rank, p.src.chunk, p.src.name)], s, s_cols, off, p.ncols, p.nrows, p.ncols])
                off += p.numel
            table = self._tables[cache_key] = PieceTable(torch.tensor(rows, dtype=torch.int64))
        execute_pieces(buf, srcs, table, backend=self.backend)

    def _fill(self, dst: torch.Tensor, dst_base: dict[Key, int], pieces: list[Piece],
              received: dict[int, tuple[torch.Tensor, list[Piece]]], cache_key=None) -> None:
        local = [p for p in pieces if p.src is not None and self.src_rank(p) == self.rank]
        srcs, index = self.local_sources(local)
        srcs += [buf for _, (buf, _) in sorted(received.items())]
        # The table depends only on the plan: build it once per destination buffer and reuse it every sync
        # (the kernel caches its validation and tiling on the PieceTable object).
        table = self._tables.get(cache_key) if cache_key is not None else None
        if table is None:
            table = self._table(dst_base, pieces, received, index, len(srcs) - len(received))
            if cache_key is not None:
                self._tables[cache_key] = table
        if table is not None:
            execute_pieces(dst, srcs, table, backend=self.backend)

    def _table(self, dst_base, pieces, received, index, first_recv: int) -> PieceTable | None:
        rows = []
        for p in pieces:
            if p.src is None:
                rows.append(piece_row(p, -1, None, None, dst_base[(p.dst.rank, p.dst.chunk, p.dst.name)]))
            elif self.src_rank(p) == self.rank:
                rows.append(piece_row(p, index[(p.src.rank, p.src.chunk, p.src.name)], None, None,
                                      dst_base[(p.dst.rank, p.dst.chunk, p.dst.name)]))
        wanted = {id(p) for p in pieces}
        for i, (peer, (buf, ps)) in enumerate(sorted(received.items())):
            off = 0
            for p in ps:
                if id(p) in wanted:
                    rows.append(piece_row(p, first_recv + i, off, p.ncols,
                                          dst_base[(p.dst.rank, p.dst.chunk, p.dst.name)]))
                off += p.numel
        return PieceTable(torch.tensor(rows, dtype=torch.int64)) if rows else None

    def write_into(self, destinations: Callable[[TensorRef], torch.Tensor]) -> None:
        """Write every destination tensor this process owns in place (converters, the reference engine)."""
        for bucket in self.buckets:
            received = self.exchange(bucket)
            mine = [k for k in bucket.keys if self.owner(k[0]) == self.rank]
            by_key: dict[Key, list[Piece]] = defaultdict(list)
            for p in bucket.pieces:
                by_key[(p.dst.rank, p.dst.chunk, p.dst.name)].append(p)
            for k in mine:
                ref = self.plan.dst_tensors[k]
                t = destinations(ref)
                if tuple(t.shape) != ref.shape:
                    raise ValueError(f"destination {k[2]} has shape {tuple(t.shape)}, the layout table expects "
                                     f"{ref.shape}")
                if not t.is_contiguous():
                    raise ValueError(f"destination {k[2]} is not contiguous")
                self._fill(t.view(-1), {k: 0}, by_key[k], received, cache_key=("into", k))

    def stream(self) -> Iterator[dict[int, list[tuple[str, torch.Tensor]]]]:
        """Yield, per bucket, {dst rank: [(name, tensor)]} for the destination ranks this process owns.

        Each bucket is one flat buffer per destination rank, written by one kernel call; the tensors are
        views into it, valid until the next bucket is requested.
        """
        for bi, bucket in enumerate(self.buckets):
            received = self.exchange(bucket)
            out: dict[int, list[tuple[str, torch.Tensor]]] = {}
            by_rank: dict[int, list[Key]] = defaultdict(list)
            for k in bucket.keys:
                if self.owner(k[0]) == self.rank:
                    by_rank[k[0]].append(k)
            for r, keys in sorted(by_rank.items()):
                base, off = {}, 0
                for k in keys:
                    base[k] = off
                    off += _numel(self.plan.dst_tensors[k].shape)
                buf = self._stream_buffer(r, off, bucket.fp32)
                kset = set(keys)
                self._fill(buf, base, [p for p in bucket.pieces if (p.dst.rank, p.dst.chunk, p.dst.name) in kset],
                           received, cache_key=("stream", bi, r))
                out[r] = [(k[2], buf[base[k]: base[k] + _numel(self.plan.dst_tensors[k].shape)]
                           .view(self.plan.dst_tensors[k].shape)) for k in keys]
            if self.device.type == "cuda":
                # The consumer may be another process (SGLang's scheduler through CUDA IPC): our writes must
                # be done before it reads, and it must be done reading before we overwrite (its loader syncs).
                torch.cuda.current_stream(self.device).synchronize()
            yield out

    def _stream_buffer(self, dst_rank: int, numel: int, fp32: bool) -> torch.Tensor:
        """One reused buffer per destination rank (and dtype), sized for the largest bucket: the same storage
        every sync, so a CUDA IPC handle to it is opened once by the engine, not once per bucket."""
        buf = self._bufs.get((dst_rank, fp32))
        if buf is None:
            need = max(sum(_numel(self.plan.dst_tensors[k].shape) for k in b.keys if k[0] == dst_rank)
                       for b in self.buckets if b.fp32 == fp32)
            dtype = torch.float32 if fp32 else self.dtype
            buf = self._bufs[(dst_rank, fp32)] = torch.empty(need, dtype=dtype, device=self.device)
        return buf[:numel]
