"""Piece tables: the resharding planner's output, their validation, and the torch reference executor.

A piece is one 2-D block copy between flat tensors:
    src[src_index].flat[src_offset + r*src_row_stride + c] -> dst.flat[dst_offset + r*dst_row_stride + c]
for r < nrows, c < ncols; src_index = -1 fills zeros. Offsets and strides count elements of the
respective tensor's dtype, so a bf16 source and an fp32 destination each use their own units.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

# Column order of PieceTable.rows.
SRC_INDEX, SRC_OFFSET, SRC_STRIDE, DST_OFFSET, DST_STRIDE, NROWS, NCOLS = range(7)
FILL = -1

# Any offset/stride/size beyond 2**48 elements is nonsense for GPU memory and would let the int64
# end-of-piece arithmetic below overflow, so it is rejected outright.
_MAX_FIELD = 1 << 48

# Casts the executors perform. Both torch and Triton round fp32 -> bf16/fp16 to nearest-even, so the
# two agree bit for bit; float64 is excluded because torch narrows it through fp32 (double rounding).
CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PieceTableError(ValueError):
    """A piece table, or the tensors passed with it, cannot be executed as given."""


def stamped_cache(cache: dict, rows: torch.Tensor) -> dict:
    """`cache`, emptied first if `rows` was replaced or edited in place since it was last stamped (identity, storage
    address and version counter): the caches of derived table data (PieceTable, ScatterTable) rest on this."""
    stamp = (id(rows), rows.data_ptr(), rows._version)
    if cache.get("stamp") != stamp:
        cache.clear()
        cache["stamp"] = stamp
    return cache


@dataclass
class PieceTable:
    """int64 tensor [N, 7], one row per piece (see module docstring). Treat as immutable once used:
    executors cache derived data (validation, Triton tile plans) keyed on the tensor's identity and
    version counter, so in-place edits are detected but rebuilding a table is the intended use."""

    rows: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rows, torch.Tensor):
            raise PieceTableError(f"PieceTable.rows must be a torch.Tensor, got {type(self.rows).__name__}")
        if self.rows.dtype != torch.int64 or self.rows.dim() != 2 or self.rows.shape[1] != 7:
            raise PieceTableError(
                f"PieceTable.rows must be int64 [N, 7], got {self.rows.dtype} {list(self.rows.shape)}")

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def derived(self) -> dict:
        """Per-table cache for derived data; emptied whenever `rows` is replaced or edited in place."""
        return stamped_cache(self._cache, self.rows)

    def numpy(self) -> np.ndarray:
        """The rows as a host int64 array (one device->host copy per table version)."""
        cache = self.derived()
        if "numpy" not in cache:
            cache["numpy"] = self.rows.detach().to("cpu").contiguous().numpy().copy()
        return cache["numpy"]

    @staticmethod
    def from_rows(rows: Sequence[Sequence[int]]) -> "PieceTable":
        return PieceTable(torch.tensor(list(rows), dtype=torch.int64).reshape(-1, 7))


def _first_bad(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def validate(table: PieceTable, dst_numel: int, src_numels: Sequence[int], check_overlap: bool = True,
             piece_ids: np.ndarray | None = None) -> None:
    """Raise PieceTableError naming the first bad piece: negative or absurd sizes/offsets/strides,
    a source index out of range, a read or write out of bounds, or (check_overlap) two pieces that
    write the same destination element. Empty pieces (nrows or ncols == 0) are always allowed.
    `piece_ids` (one per row) are the numbers messages use for the pieces, so a caller validating a
    sub-table (execute_scatter) names the pieces as its user numbered them; default 0..N-1.
    Cost: O(N) plus, for the overlap check, O(R log R) over R destination row segments."""
    rows = table.numpy()
    ids = np.arange(len(rows)) if piece_ids is None else np.asarray(piece_ids)
    n_src = len(src_numels)
    if rows.size == 0:
        return
    bad = _first_bad((rows[:, 1:] < 0).any(axis=1))
    if bad is not None:
        raise PieceTableError(f"piece {int(ids[bad])}: negative offset, stride or size in {rows[bad].tolist()}")
    bad = _first_bad((rows[:, 1:] > _MAX_FIELD).any(axis=1))
    if bad is not None:
        raise PieceTableError(f"piece {int(ids[bad])}: offset, stride or size above 2**48 in {rows[bad].tolist()}")
    src_idx = rows[:, SRC_INDEX]
    bad = _first_bad((src_idx < FILL) | (src_idx >= n_src))
    if bad is not None:
        raise PieceTableError(
            f"piece {int(ids[bad])}: src_index {int(src_idx[bad])} out of range "
            f"(-1 for zero fill, or 0..{n_src - 1})")
    nr, nc = rows[:, NROWS], rows[:, NCOLS]
    live = (nr > 0) & (nc > 0)
    # One past the last element touched; only meaningful for non-empty pieces.
    dst_end = rows[:, DST_OFFSET] + (nr - 1) * rows[:, DST_STRIDE] + nc
    bad = _first_bad(live & (dst_end > dst_numel))
    if bad is not None:
        raise PieceTableError(
            f"piece {int(ids[bad])}: writes dst elements up to {int(dst_end[bad])} but dst has {dst_numel} "
            f"(row {rows[bad].tolist()})")
    bad = _first_bad(live & (nr > 1) & (rows[:, DST_STRIDE] < nc))
    if bad is not None:
        raise PieceTableError(
            f"piece {int(ids[bad])}: dst_row_stride {int(rows[bad, DST_STRIDE])} < ncols {int(nc[bad])} "
            "makes the piece overlap itself in dst")
    numels = np.asarray(list(src_numels) + [0], dtype=np.int64)  # index -1 -> the dummy 0
    src_end = rows[:, SRC_OFFSET] + (nr - 1) * rows[:, SRC_STRIDE] + nc
    bad = _first_bad(live & (src_idx >= 0) & (src_end > numels[src_idx]))
    if bad is not None:
        raise PieceTableError(
            f"piece {int(ids[bad])}: reads src {int(src_idx[bad])} elements up to {int(src_end[bad])} but it has "
            f"{int(numels[src_idx[bad]])} (row {rows[bad].tolist()})")
    if check_overlap:
        _check_no_dst_overlap(rows[live], ids[live])


def _check_no_dst_overlap(rows: np.ndarray, piece_ids: np.ndarray) -> None:
    """Expand each piece into its destination row segments (a row-contiguous piece is one segment),
    sort by start, and require each segment to end before the next begins. Exact, unlike comparing
    bounding ranges, which would reject the common case of column blocks interleaved row by row."""
    nr, nc, ds = rows[:, NROWS], rows[:, NCOLS], rows[:, DST_STRIDE]
    contiguous = (nr == 1) | (ds == nc)
    seg_rows = np.where(contiguous, 1, nr)
    seg_len = np.where(contiguous, nr * nc, nc)
    owner = np.repeat(np.arange(len(rows)), seg_rows)
    first = np.cumsum(seg_rows) - seg_rows
    r = np.arange(int(seg_rows.sum()), dtype=np.int64) - np.repeat(first, seg_rows)
    start = rows[owner, DST_OFFSET] + r * ds[owner]
    end = start + seg_len[owner]
    order = np.argsort(start, kind="stable")
    start, end, owner = start[order], end[order], owner[order]
    clash = _first_bad(start[1:] < end[:-1])
    if clash is not None:
        a, b = sorted((int(piece_ids[owner[clash]]), int(piece_ids[owner[clash + 1]])))
        raise PieceTableError(
            f"piece {b}: overlaps piece {a} in dst at element {int(start[clash + 1])}")


class SrcMeta(NamedTuple):
    data_ptr: int
    numel: int
    dtype: torch.dtype


def _sweep_srcs(srcs: Sequence[torch.Tensor]) -> tuple:
    """One attribute sweep per source, no views: an executor may get a thousand sources per call."""
    try:
        return tuple([(s.data_ptr(), s.numel(), s.dtype, s.is_contiguous(), s.get_device()) for s in srcs])
    except AttributeError:
        bad = next(i for i, s in enumerate(srcs) if not isinstance(s, torch.Tensor))
        raise PieceTableError(f"srcs[{bad}] must be a torch.Tensor, got {type(srcs[bad]).__name__}") from None


def _check_dst(dst: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor) or dst.dim() != 1 or not dst.is_contiguous():
        raise PieceTableError(
            f"dst must be a flat contiguous 1-D tensor, got shape {getattr(dst, 'shape', None)}")


def _meta_of(dst: torch.Tensor, srcs: Sequence[torch.Tensor], raw: tuple) -> list[SrcMeta]:
    dev, dt = dst.get_device(), dst.dtype
    for i, (_, _, sdt, contiguous, sdev) in enumerate(raw):
        if not contiguous:
            raise PieceTableError(f"srcs[{i}] must be a contiguous tensor")
        if sdev != dev:
            raise PieceTableError(f"srcs[{i}] is on {srcs[i].device} but dst is on {dst.device}")
        if sdt != dt and (sdt not in CAST_DTYPES or dt not in CAST_DTYPES):
            raise PieceTableError(
                f"srcs[{i}] has dtype {sdt} and dst {dt}: casts are supported only among "
                f"{[str(d) for d in CAST_DTYPES]}")
    return [SrcMeta(p, n, d) for p, n, d, _, _ in raw]


def check_tensors(dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> list[SrcMeta]:
    """Check dst/srcs against the contract; return what the executors need of each source."""
    _check_dst(dst)
    return _meta_of(dst, srcs, _sweep_srcs(srcs))


def validate_call(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable) -> list[SrcMeta]:
    """Tensor checks + table validation, the latter cached per (table version, dst and src sizes).
    The attribute sweep runs on every call (a tensor may have moved or changed since the last one),
    but when it equals the previous call's on this table exactly, that call's checked SrcMeta list
    is reused: with ~1000 sources, building it again costs about as much host time as the sweep
    itself, and host time here adds to the sync's critical path (docs/archive/results-2026-11.md, section "MoE
    bucket spread")."""
    _check_dst(dst)
    raw = _sweep_srcs(srcs)
    dkey = (dst.data_ptr(), dst.numel(), dst.dtype, dst.get_device())
    cache = table.derived()
    last = cache.get("last_call")
    if last is not None and last[0] == dkey and last[1] == raw:
        return last[2]
    meta = _meta_of(dst, srcs, raw)
    key = ("valid", dst.numel(), tuple(m.numel for m in meta))
    if key not in cache:
        validate(table, dst.numel(), [m.numel for m in meta])
        cache[key] = True
    cache["last_call"] = (dkey, raw, meta)
    return meta


def execute_pieces_torch(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable) -> None:
    """Reference executor: one as_strided view pair and one copy_ (which casts) per piece."""
    validate_call(dst, srcs, table)
    copy_pieces_torch(dst, srcs, table)


def copy_pieces_torch(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable) -> None:
    """The torch executor's copy loop, for a call already validated (also used by execute_scatter)."""
    d0 = dst.storage_offset()
    for i, so, ss, do, ds, nr, nc in table.numpy().tolist():
        if nr == 0 or nc == 0:
            continue
        out = dst.as_strided((nr, nc), (ds, 1), d0 + do)
        if i == FILL:
            out.zero_()
        else:
            src = srcs[i]  # contiguous, any shape: as_strided addresses its storage directly
            out.copy_(src.as_strided((nr, nc), (ss, 1), src.storage_offset() + so))
