"""Delta weight sync (sync.delta): each bucket buffer a training rank sends an engine rank travels as the elements
whose bits changed since the last sync (indices + values), or whole where that would not be smaller.

Between two RL steps only a few per cent of the engine's (bf16) weights change: an optimizer update smaller than half
a bf16 unit in the last place moves the float32 main copy but not the bf16 value (mtrain/trainer/weight_change.py).
The remote sync (mtrain/reshard/remote.py) packs, per bucket and engine rank, one buffer of exactly the elements
that engine rank needs; `DeltaExecutor` replaces its `exchange` and nothing else, so the plan, the buckets, the pull
tables and the engine-side code are those of the full sync.

Per (bucket, engine rank) message, two point-to-point phases:
  1. a header, int64 [1]: -1 = the whole buffer follows; k >= 0 = k changed elements follow (0: nothing follows);
  2. the whole buffer, or one uint8 buffer holding k indices (int32, or int64 for buffers of 2**31 elements or
     more) then the k new values in the sync dtype.
Sparse is chosen when k * (index size + value size) < n * value size: below 1/3 of the elements for bf16 with
int32 indices. Changes are found by comparing bits (integer views), not values, so -0.0 vs 0.0 and NaN payloads
travel too: the engine's buffer is bit-equal to the full sync's, always.

What each side keeps:
- sender (`DeltaSender`, one per training rank, shared by its executors of every engine): the last buffer it sent
  per distinct buffer content (which source slices, in which order) — the packed buffer itself, kept instead of
  freed, so no copy is made. Memory: this rank's share of one engine's weights in the sync dtype, on the training
  device, when every engine takes the same slices from it (the usual case: training DP 1, or engines of one
  layout); up to one share per engine where the planner spreads replicated sources over DP replicas differently
  per engine. Equal buffers are encoded once per sync and the encoding is reused for every engine.
- receiver (`DeltaExecutor` on an engine rank): a mirror of every buffer it received, to apply the delta to, which
  it then copies into the pull protocol's receive buffer. Memory: one copy of this engine rank's weights in the sync
  dtype, on the engine rank's device (the GPU that also holds the engine).
The first sync, and any after a receiver lost its mirror (a new process), is full; a sender with no kept buffer
sends whole.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from mtrain.reshard.executor import Bucket, Executor, Piece

FULL = -1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < (1 << 31) else torch.int64


def sparse_pays(k: int, n: int, value_size: int) -> bool:
    """Indices + values are smaller than the whole buffer (the fallback threshold)."""
    index_size = torch.empty((), dtype=_index_dtype(n)).element_size()
    return k * (index_size + value_size) < n * value_size


class DeltaSender:
    """A training rank's kept buffers and this sync's encodings, shared by its executors (one per engine)."""

    def __init__(self) -> None:
        self.last: dict[tuple, torch.Tensor] = {}
        self._now: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.reset_stats()

    def begin(self) -> None:
        """A new sync: encodings are computed afresh (the trainer's weights have changed since the last one)."""
        self._now = {}

    def reset_stats(self) -> None:
        self.stats = {"elements": 0, "changed": 0, "full_sends": 0, "sparse_sends": 0, "wire_bytes": 0}

    def encode(self, key: tuple, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(header, payload or None) for the packed buffer `buf` of `key` (bucket index, destination rank)."""
        hit = self._now.get(key)
        if hit is None:
            hit = self._now[key] = self._encode(key, buf)
        head, payload = hit
        s = self.stats
        s["elements"] += buf.numel()
        k = int(head.item())
        s["changed"] += buf.numel() if k == FULL else k
        s["full_sends" if k == FULL else "sparse_sends"] += 1
        s["wire_bytes"] += head.numel() * 8 + (payload.numel() * payload.element_size() if payload is not None else 0)
        return head, payload

    def _encode(self, key: tuple, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        prev = self.last.get(key)
        self.last[key] = buf  # the buffer just packed: nobody writes it again (a fresh one is packed next sync)
        head = torch.empty(1, dtype=torch.int64, device=buf.device)
        if prev is None or prev.shape != buf.shape or prev.dtype != buf.dtype:
            head.fill_(FULL)
            return head, buf
        idx = torch.nonzero(_bits(buf) != _bits(prev)).view(-1)
        k, n = idx.numel(), buf.numel()
        if not sparse_pays(k, n, buf.element_size()):
            head.fill_(FULL)
            return head, buf
        head.fill_(k)
        if k == 0:
            return head, None
        payload = torch.cat([idx.to(_index_dtype(n)).view(torch.uint8), buf[idx].view(torch.uint8)])
        return head, payload


def _wait(ops: list) -> None:
    peers = [op.peer for op in ops]
    works = dist.batch_isend_irecv(ops) if ops else []
    for i, work in enumerate(works):
        try:
            work.wait()
        except Exception as e:  # name the peer, as Executor.exchange does
            e.add_note(f"peer rank {peers[i]}" if len(works) == len(ops) else f"peer ranks {sorted(set(peers))}")
            raise


class DeltaExecutor(Executor):
    """An `Executor` whose `exchange` moves deltas (module docstring). `sender` on training ranks; engine ranks
    keep their mirrors themselves."""

    def __init__(self, *args, sender: DeltaSender | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sender = sender
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        self.mirrors: dict[tuple[int, int], torch.Tensor] = {}  # (bucket index, peer) -> what it last received
        self.received_bytes = 0
        self._signatures: dict[tuple[int, int], tuple] = {}

    def _signature(self, bucket: Bucket, peer: int, pieces: list[Piece]) -> tuple:
        """What a send buffer holds, element by element: engines whose plans pick the same source slices for a
        destination rank get equal buffers and share one kept copy and one encoding; where the planner spreads
        the sending of replicated sources differently per engine, the buffers differ and are kept apart."""
        sig = self._signatures.get((id(bucket), peer))
        if sig is None:
            sig = self._signatures[(id(bucket), peer)] = (bucket.fp32, tuple(
                (p.src.rank, p.src.chunk, p.src.name, p.src_slot, p.src_row, p.src_col, p.nrows, p.ncols)
                for p in pieces))
        return sig

    def exchange(self, bucket: Bucket, recv_buffer: Callable[[int, int, bool], torch.Tensor] | None = None
                 ) -> dict[int, tuple[torch.Tensor, list[Piece]]]:
        send, recv = self.transfers(bucket)
        dtype, bi = self._dtype(bucket), self._index[id(bucket)]
        if send and self.sender is None:
            raise RuntimeError(f"rank {self.rank} sends weights but has no DeltaSender")
        encoded, heads, ops = {}, {}, []
        for peer in sorted(send):
            ps = send[peer]
            buf = torch.empty(sum(p.numel for p in ps), dtype=dtype, device=self.device)
            self._pack(buf, ps, cache_key=("pack", id(bucket), peer))
            encoded[peer] = self.sender.encode(self._signature(bucket, peer, ps), buf)
            ops.append(dist.P2POp(dist.isend, encoded[peer][0], peer, group=self.group))
        for peer in sorted(recv):
            heads[peer] = torch.empty(1, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, heads[peer], peer, group=self.group))
        _wait(ops)

        ops, payloads = [], {}
        for peer in sorted(send):
            payload = encoded[peer][1]
            if payload is not None:
                ops.append(dist.P2POp(dist.isend, payload, peer, group=self.group))
        for peer in sorted(recv):
            n = sum(p.numel for p in recv[peer])
            k = int(heads[peer].item())
            mirror = self.mirrors.get((bi, peer))
            if k == FULL:
                if mirror is None:
                    mirror = self.mirrors[(bi, peer)] = torch.empty(n, dtype=dtype, device=self.device)
                payloads[peer] = (k, mirror)
                ops.append(dist.P2POp(dist.irecv, mirror, peer, group=self.group))
            elif mirror is None or k > n:
                raise RuntimeError(f"delta sync: rank {peer} sent a delta of {k} elements for bucket {bi} of {n}, "
                                   f"but rank {self.rank} holds no full copy of it to apply it to")
            elif k > 0:
                size = k * (torch.empty((), dtype=_index_dtype(n)).element_size() + mirror.element_size())
                payloads[peer] = (k, torch.empty(size, dtype=torch.uint8, device=self.device))
                ops.append(dist.P2POp(dist.irecv, payloads[peer][1], peer, group=self.group))
        _wait(ops)

        out = {}
        for peer in sorted(recv):
            n = sum(p.numel for p in recv[peer])
            mirror = self.mirrors[(bi, peer)]
            k, got = payloads.get(peer, (0, None))
            self.received_bytes += 8 + (got.numel() * got.element_size() if got is not None else 0)
            if k > 0:
                cut = k * torch.empty((), dtype=_index_dtype(n)).element_size()
                idx = got[:cut].view(_index_dtype(n)).long()
                if k and (int(idx.min()) < 0 or int(idx.max()) >= n):
                    raise RuntimeError(f"delta sync: rank {peer} sent an index outside bucket {bi} ({n} elements)")
                mirror[idx] = got[cut:].view(dtype)
            buf = mirror.clone() if recv_buffer is None else recv_buffer(peer, n, bucket.fp32)
            if recv_buffer is not None:
                buf.copy_(mirror)
            out[peer] = (buf, recv[peer])
        return out


def delta_metrics(sender: DeltaSender | None, executors: list[Executor]) -> dict[str, float]:
    """This sync's figures on this rank: bytes on the wire (headers, indices, values; what a training rank sent or
    an engine rank received) and, on a training rank, the share of sent elements that changed."""
    if sender is not None:
        s = sender.stats
        sends = s["full_sends"] + s["sparse_sends"]
        out = {"sync/wire_bytes": float(s["wire_bytes"]),
               "sync/delta_changed_frac": s["changed"] / s["elements"] if s["elements"] else 0.0,
               "sync/delta_full_frac": s["full_sends"] / sends if sends else 0.0}
        sender.reset_stats()
        return out
    got = sum(getattr(ex, "received_bytes", 0) for ex in executors)
    for ex in executors:
        ex.received_bytes = 0
    return {"sync/wire_bytes": float(got)}
