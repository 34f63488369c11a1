"""Scatter: one piece table writing into MANY destination tensors, one Triton launch per dst dtype.

The weight-sync loader inside SGLang writes straight into the engine's parameters: separate
allocations, ~300 for a dense 8B model, mostly bf16 and a few fp32. One launch per parameter would
spend more time in Python than in copying, so the Triton backend groups destinations by dtype and
rebases each group's rows onto its lowest destination, DST_OFFSET += (data_ptr - lowest data_ptr) /
itemsize. The shared launch (triton_pieces.launch_pieces) then sees one flat destination whose
pieces lie in different allocations, the way sources in different allocations are already reached
through slot bases. Pieces are validated per destination, so no write leaves its own tensor, and
written destinations may not overlap each other in memory (two over the same bytes would race).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .pieces import (CAST_DTYPES, DST_OFFSET, NCOLS, NROWS, SRC_INDEX, PieceTable, PieceTableError,
                     SrcMeta, copy_pieces_torch, stamped_cache, validate)


@dataclass(frozen=True, eq=False)  # identity semantics: fields hold arrays, and caches key on the object
class ScatterTable:
    """A piece table plus, per row, the destination it writes. DST_OFFSET/DST_STRIDE count elements
    of that row's own destination. Immutable: derived data (validation, per-dtype rebased tables
    and their tile plans) is cached on the object and rebuilt if `table.rows` is edited in place."""

    table: PieceTable
    dst_index: np.ndarray  # int64 [N]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.table, PieceTable):
            raise PieceTableError(f"ScatterTable.table must be a PieceTable, got {type(self.table).__name__}")
        idx = self.dst_index
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        idx = np.asarray(idx)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise PieceTableError(
                f"ScatterTable.dst_index must be a 1-D integer array, got {idx.dtype} {list(idx.shape)}")
        idx = idx.astype(np.int64, copy=True)
        idx.flags.writeable = False  # cached groupings depend on it
        object.__setattr__(self, "dst_index", idx)
        self._check_length()

    def _check_length(self) -> None:
        if len(self.dst_index) != len(self.table):
            raise PieceTableError(f"ScatterTable.dst_index has {len(self.dst_index)} entries but the table "
                                  f"has {len(self.table)} pieces")

    def __len__(self) -> int:
        return len(self.table)

    def derived(self) -> dict:
        """Per-object cache, emptied whenever the piece rows are replaced or edited in place."""
        return stamped_cache(self._cache, self.table.rows)

    @staticmethod
    def from_rows(rows: Sequence[Sequence[int]]) -> "ScatterTable":
        """8 ints per row: the 7 piece fields, then the destination index."""
        try:  # also takes an [N, 8] integer array as is
            arr = np.asarray(rows, dtype=np.int64).reshape(-1, 8)
        except (TypeError, ValueError, OverflowError) as exc:
            raise PieceTableError(f"ScatterTable.from_rows needs rows of 8 integers: {exc}") from None
        return ScatterTable(PieceTable(torch.from_numpy(np.ascontiguousarray(arr[:, :7]))), arr[:, 7])


class _Sub(NamedTuple):
    """One destination's rows: their ids in the scatter table, as a PieceTable, and the sources read."""
    ids: np.ndarray
    table: PieceTable
    used_srcs: np.ndarray
    writes: bool  # has a non-empty piece


class _Group(NamedTuple):
    """One launch: destinations of one dtype rebased onto `anchor` (the lowest), sources remapped."""
    anchor: int
    table: PieceTable
    used_srcs: list[int]


def _structure(st: ScatterTable) -> dict[int, _Sub]:
    cache = st.derived()
    if "structure" not in cache:
        st._check_length()  # `table.rows` may have been replaced by rows of another length
        rows = st.table.numpy()
        order = np.argsort(st.dst_index, kind="stable")
        dst_ids, starts = np.unique(st.dst_index[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        subs = {}
        for d, a, b in zip(dst_ids.tolist(), starts.tolist(), ends.tolist()):
            ids = order[a:b]
            part = rows[ids]
            src = part[:, SRC_INDEX]
            writes = bool(((part[:, NROWS] > 0) & (part[:, NCOLS] > 0)).any())
            subs[d] = _Sub(ids, PieceTable(torch.from_numpy(part)), np.unique(src[src >= 0]), writes)
        cache["structure"] = subs
    return cache["structure"]


def _sweep(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> tuple[list[SrcMeta], list[SrcMeta]]:
    """Per-call tensor checks; one attribute sweep per tensor (a call may pass hundreds of each)."""
    for i, d in enumerate(dsts):
        if not isinstance(d, torch.Tensor) or d.dim() != 1 or not d.is_contiguous():
            raise PieceTableError(
                f"dsts[{i}] must be a flat contiguous 1-D tensor, got shape {getattr(d, 'shape', None)}"
                + ("" if not isinstance(d, torch.Tensor) or d.dim() != 1 else " (not contiguous)"))
    for i, s in enumerate(srcs):
        if not isinstance(s, torch.Tensor):
            raise PieceTableError(f"srcs[{i}] must be a torch.Tensor, got {type(s).__name__}")
        if not s.is_contiguous():
            raise PieceTableError(f"srcs[{i}] must be a contiguous tensor")
    named = [("dsts", i, t) for i, t in enumerate(dsts)] + [("srcs", i, t) for i, t in enumerate(srcs)]
    if named:
        device = named[0][2].device
        for kind, i, t in named:
            if t.device != device:
                raise PieceTableError(f"{kind}[{i}] is on {t.device} but {named[0][0]}[0] is on {device}: "
                                      "all destinations and sources must share one device")
    dmeta = [SrcMeta(d.data_ptr(), d.numel(), d.dtype) for d in dsts]
    smeta = [SrcMeta(s.data_ptr(), s.numel(), s.dtype) for s in srcs]
    return dmeta, smeta


def _validate_sizes(st: ScatterTable, subs: dict[int, _Sub], dst_numels: tuple, src_numels: tuple) -> None:
    idx, n_dst = st.dst_index, len(dst_numels)
    bad = np.flatnonzero((idx < 0) | (idx >= n_dst))
    if bad.size:
        k = int(bad[0])
        raise PieceTableError(f"piece {k}: dst_index {int(idx[k])} out of range for {n_dst} destinations "
                              f"(0..{n_dst - 1})")
    for d, sub in subs.items():
        try:
            validate(sub.table, dst_numels[d], src_numels, piece_ids=sub.ids)
        except PieceTableError as exc:
            raise PieceTableError(f"dsts[{d}]: {exc}") from None


def _validate_dtypes(subs: dict[int, _Sub], dst_dtypes: tuple, src_dtypes: tuple) -> None:
    """The cast rules of execute_pieces, per destination and only for the sources it reads: an fp8
    destination filled from fp8 shards may share a call with bf16 ones filled from bf16 shards."""
    for d, sub in subs.items():
        dt = dst_dtypes[d]
        for i in sub.used_srcs.tolist():
            sdt = src_dtypes[i]
            if sdt != dt and (sdt not in CAST_DTYPES or dt not in CAST_DTYPES):
                raise PieceTableError(f"srcs[{i}] has dtype {sdt} and dsts[{d}] {dt}: casts are supported "
                                      f"only among {[str(c) for c in CAST_DTYPES]}")


def _check_dsts_disjoint(subs: dict[int, _Sub], dmeta: list[SrcMeta]) -> None:
    """Destinations the table writes must not share bytes: one launch writes them all at once.
    Compared as whole [data_ptr, data_ptr + nbytes) ranges; unwritten ones (e.g. a tied weight
    passed twice but written once) cannot race and are left out."""
    ids = [d for d, sub in subs.items() if sub.writes and dmeta[d].numel > 0]
    if len(ids) < 2:
        return
    start = np.array([dmeta[d].data_ptr for d in ids], np.int64)
    end = start + np.array([dmeta[d].numel * dmeta[d].dtype.itemsize for d in ids], np.int64)
    order = np.argsort(start, kind="stable")
    clash = np.flatnonzero(start[order][1:] < end[order][:-1])
    if clash.size:
        a, b = sorted((ids[order[clash[0]]], ids[order[clash[0] + 1]]))
        span = {d: f"[{dmeta[d].data_ptr:#x}, +{dmeta[d].numel * dmeta[d].dtype.itemsize} bytes)" for d in (a, b)}
        raise PieceTableError(f"dsts[{a}] {span[a]} and dsts[{b}] {span[b]} overlap in memory: two destinations "
                              "over the same bytes would race")


def _raw_sweep(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """Everything _sweep checks, as one tuple per tensor (None if one is not a tensor: _sweep says which)."""
    try:
        return tuple([(t.data_ptr(), t.numel(), t.dtype, t.is_contiguous(), t.get_device(), t.dim())
                      for t in tensors])
    except AttributeError:
        return None


def _prepare(dsts, srcs, st: ScatterTable) -> tuple[dict[int, _Sub], list[SrcMeta], list[SrcMeta]]:
    """Every check of execute_scatter, before anything is written; table work cached on `st`.
    A call whose tensors match the previous call's exactly (addresses, sizes, dtypes, contiguity,
    device, rank) gets that call's checked result back: the loader repeats the same call every sync,
    and with ~1000 sources the checks cost more host time than the launch's GPU work is long
    (docs/archive/results-2026-11.md, "MoE bucket spread")."""
    if not isinstance(st, ScatterTable):
        raise PieceTableError(f"table must be a ScatterTable, got {type(st).__name__}")
    subs = _structure(st)
    cache = st.derived()
    raw = (_raw_sweep(dsts), _raw_sweep(srcs))
    last = cache.get("last_prepare")
    if raw[0] is not None and raw[1] is not None and last is not None and last[0] == raw:
        return last[1]
    result = _prepare_checked(dsts, srcs, st, subs, cache)
    if raw[0] is not None and raw[1] is not None:
        cache["last_prepare"] = (raw, result)
    return result


def _prepare_checked(dsts, srcs, st: ScatterTable, subs, cache) -> tuple[dict[int, _Sub], list[SrcMeta], list[SrcMeta]]:
    dmeta, smeta = _sweep(dsts, srcs)
    dst_numels, src_numels = tuple(m.numel for m in dmeta), tuple(m.numel for m in smeta)
    if ("valid", dst_numels, src_numels) not in cache:
        _validate_sizes(st, subs, dst_numels, src_numels)
        cache["valid", dst_numels, src_numels] = True
    dst_dtypes, src_dtypes = tuple(m.dtype for m in dmeta), tuple(m.dtype for m in smeta)
    if ("dtypes", dst_dtypes, src_dtypes) not in cache:
        _validate_dtypes(subs, dst_dtypes, src_dtypes)
        cache["dtypes", dst_dtypes, src_dtypes] = True
    # Pointer-dependent results keep only the latest layout: the loader passes the same tensors
    # every sync, and a caller cycling through many would otherwise grow the cache without bound.
    layout = (tuple(m.data_ptr for m in dmeta), dst_dtypes, dst_numels)
    if cache.get("disjoint") != layout:
        _check_dsts_disjoint(subs, dmeta)
        cache["disjoint"] = layout
    return subs, dmeta, smeta


def execute_scatter_torch(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], table: ScatterTable) -> None:
    """Reference: the torch executor's copy loop over each destination's cached sub-table."""
    subs, _, _ = _prepare(dsts, srcs, table)
    for d, sub in subs.items():
        copy_pieces_torch(dsts[d], srcs, sub.table)


def _groups(st: ScatterTable, subs: dict[int, _Sub], dmeta: list[SrcMeta], raw_sizes: Sequence[int]) -> list[_Group]:
    """Rebased per-dtype tables, cached per destination layout (pointers, dtypes); their tile plans
    are cached on the rebased PieceTables themselves, so a repeated sync re-plans nothing."""
    cache = st.derived()
    layout = (tuple(m.data_ptr for m in dmeta), tuple(m.dtype for m in dmeta))
    if cache.get("groups_key") == layout:
        return cache["groups"]
    rows = st.table.numpy()
    by_dtype: dict[torch.dtype, list[int]] = {}
    for d, sub in subs.items():
        if sub.writes:
            by_dtype.setdefault(dmeta[d].dtype, []).append(d)
    groups = []
    for dtype, members in by_dtype.items():
        esize = dtype.itemsize
        if esize not in raw_sizes:  # such a dtype cannot cast either, so the launch would be a raw copy
            raise PieceTableError(f"dsts[{members[0]}] dtype {dtype} has no same-size integer type for a raw copy")
        for d in members:
            if dmeta[d].data_ptr % esize:
                raise PieceTableError(f"dsts[{d}] data pointer is not aligned to its {esize}-byte elements")
        anchor = min(members, key=lambda d: dmeta[d].data_ptr)
        parts = []
        for d in members:
            part = rows[subs[d].ids]  # fancy indexing copies
            part[:, DST_OFFSET] += (dmeta[d].data_ptr - dmeta[anchor].data_ptr) // esize
            parts.append(part)
        part = np.concatenate(parts)
        src = part[:, SRC_INDEX]
        used = np.unique(src[src >= 0])
        # Only the sources this group reads are passed to its launch, so a bf16 group fed by bf16
        # shards keeps the raw-bit copy path even when an fp32 group in the same call casts.
        part[src >= 0, SRC_INDEX] = np.searchsorted(used, src[src >= 0])
        used_list = used.tolist()
        groups.append(_Group(anchor, PieceTable(torch.from_numpy(part)), used_list))
    cache["groups_key"], cache["groups"] = layout, groups
    return groups


def _launch_groups(dsts, srcs, table: ScatterTable):
    """Every check of execute_scatter_triton, then per launch (anchor destination, its sources, their metadata,
    rebased table)."""
    from . import triton_pieces as tp  # imported here: the torch path must work without Triton

    subs, dmeta, smeta = _prepare(dsts, srcs, table)
    if not dsts:
        return []
    tp.check_device(dsts[0])
    groups = _groups(table, subs, dmeta, tuple(tp._INT_OF_SIZE))
    cache = table.derived()
    if cache.get("srcs_aligned") is not smeta:  # smeta is _prepare's cached list while the tensors repeat
        for i in sorted({i for g in groups for i in g.used_srcs}):
            esize = smeta[i].dtype.itemsize
            if smeta[i].data_ptr % esize:  # checked here, not in the launch: no group may run first
                raise PieceTableError(f"srcs[{i}] data pointer is not aligned to its {esize}-byte elements")
        cache["srcs_aligned"] = smeta
    return [(dsts[g.anchor], [srcs[i] for i in g.used_srcs], [smeta[i] for i in g.used_srcs], g.table)
            for g in groups]


def execute_scatter_triton(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], table: ScatterTable,
                           block: int | None = None, num_warps: int | None = None) -> None:
    """One Triton launch per destination dtype that the table writes (none if it writes nothing)."""
    from . import triton_pieces as tp

    for dst, g_srcs, g_meta, g_table in _launch_groups(dsts, srcs, table):
        tp.launch_pieces(dst, g_srcs, g_meta, g_table, block or tp.DEFAULT_BLOCK, num_warps or tp.DEFAULT_WARPS)


def scatter_launches(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], table: ScatterTable) -> list:
    """execute_scatter_triton's launches prepared, not run: [(kernel[grid], args, kwargs)] (the FP8 path runs them
    and keeps them to replay, scatter_fp8)."""
    from . import triton_pieces as tp

    launches = [tp._prepare_launch(dst, g_srcs, g_meta, g_table, tp.DEFAULT_BLOCK, tp.DEFAULT_WARPS, None)
                for dst, g_srcs, g_meta, g_table in _launch_groups(dsts, srcs, table)]
    return [x for x in launches if x is not None]
