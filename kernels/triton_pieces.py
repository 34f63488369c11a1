"""Triton executor: the whole piece table in ONE launch, one program per tile (see tiling.py).

Sources in different allocations: the kernel takes one base pointer per source dtype ("slot", at
most 3: fp32, bf16, fp16) and a small per-call int64 table `src_info[S, 2] = (element offset of
source s from its slot's base, slot)`. Loads are then ordinary typed pointer arithmetic
`base + (delta + offset)`, which the compiler analyses like any other (alignment hints, 16-byte
vector accesses) and which the interpreter runs too, since it reads raw host addresses on CPU.
In compiled mode the bases are the slot's lowest source address rounded down to 16 bytes (passed
as a tiny object with data_ptr()/dtype, which Triton accepts like a tensor), so every base is
16-byte aligned and each tile's alignment depends only on its offsets, strides and width: the
kernel tests that per tile and takes a hinted (vectorised) or a plain path.
Pure copies (every source has dst's dtype) move raw bits: all tensors are viewed as same-size
integers, so any 1/2/4/8-byte dtype works, including fp8 and NaN payloads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .pieces import CAST_DTYPES, PieceTable, PieceTableError, SrcMeta, validate_call
from .tiling import TILE_FIELDS, TilePlan, plan_tiles

DEFAULT_BLOCK = int(os.environ.get("MTRAIN_PIECES_BLOCK", "8192"))
DEFAULT_WARPS = int(os.environ.get("MTRAIN_PIECES_WARPS", "8"))
# Tuning knob for benchmarks: force the tile width instead of tiling.choose_block_c's pick (0 = choose).
FORCED_BLOCK_C = int(os.environ.get("MTRAIN_PIECES_BLOCK_C", "0")) or None
# Order of the tiles over program ids (tiling.TILE_ORDERS); a benchmark knob, see tiling.plan_tiles.
TILE_ORDER = os.environ.get("MTRAIN_PIECES_TILE_ORDER", "table")
MAX_SLOTS = 3
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _convert(vals, DST: tl.constexpr):
    """Cast like torch's copy_, bit for bit. Conversions to and from bf16 are done on the bits
    (round to nearest even, NaN -> 0x7FC0, as c10::BFloat16 does) because the interpreter's own
    fp32 -> bf16 cast truncates; fp16 <-> fp32 is exact or IEEE-rounded in both modes."""
    if vals.dtype == DST:
        return vals
    if DST == tl.bfloat16:
        x = vals.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if vals.dtype == tl.bfloat16:
        wide = vals.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return wide.to(tl.float32, bitcast=True).to(DST)
    return vals.to(DST)


@triton.jit
def _copy_block(src_ptr, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                VEC_S: tl.constexpr, VEC_D: tl.constexpr, VEC_MAX: tl.constexpr, HINTS: tl.constexpr):
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    if HINTS:
        # The caller checked that offsets, strides and width are multiples of the vector lengths.
        # Writing them as (x // VEC) * VEC lets the compiler's alignment analysis see that for
        # itself (tl.multiple_of hints on loaded scalars do not survive canonicalisation), and
        # comparing in units of VEC_MAX makes the column mask constant over each vector.
        s_rows = (s_off // VEC_S) * VEC_S + r * ((s_stride // VEC_S) * VEC_S)
        d_rows = (d_off // VEC_D) * VEC_D + r * ((d_stride // VEC_D) * VEC_D)
        col_ok = (c // VEC_MAX)[None, :] < (nc // VEC_MAX)
    else:
        s_rows = s_off + r * s_stride
        d_rows = d_off + r * d_stride
        col_ok = c[None, :] < nc
    mask = (r[:, None] < nr) & col_ok
    vals = tl.load(src_ptr + (s_rows[:, None] + c[None, :]), mask=mask)
    tl.store(dst_ptr + (d_rows[:, None] + c[None, :]), _convert(vals, dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fill_block(dst_ptr, d_off, d_stride, nr, nc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                VEC_D: tl.constexpr, HINTS: tl.constexpr):
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    if HINTS:  # see _copy_block
        d_rows = (d_off // VEC_D) * VEC_D + r * ((d_stride // VEC_D) * VEC_D)
        col_ok = (c // VEC_D)[None, :] < (nc // VEC_D)
    else:
        d_rows = d_off + r * d_stride
        col_ok = c[None, :] < nc
    mask = (r[:, None] < nr) & col_ok
    zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + (d_rows[:, None] + c[None, :]), zeros, mask=mask)


@triton.jit
def _copy_tile(src_ptr, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               VEC_S: tl.constexpr, VEC_D: tl.constexpr, VEC_MAX: tl.constexpr):
    aligned = ((s_off % VEC_S) == 0) & ((s_stride % VEC_S) == 0) & ((d_off % VEC_D) == 0) \
        & ((d_stride % VEC_D) == 0) & ((nc % VEC_MAX) == 0)
    if aligned:
        _copy_block(src_ptr, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                    BLOCK_R, BLOCK_C, VEC_S, VEC_D, VEC_MAX, True)
    else:
        _copy_block(src_ptr, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                    BLOCK_R, BLOCK_C, VEC_S, VEC_D, VEC_MAX, False)


@triton.jit
def _pieces_kernel(tiles_ptr, info_ptr, dst_ptr, dst_delta, src0, src1, src2,
                   N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr,
                   VEC_D: tl.constexpr, VMAX0: tl.constexpr, VMAX1: tl.constexpr, VMAX2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   TILE_FIELDS: tl.constexpr):
    row = tiles_ptr + tl.program_id(0).to(tl.int64) * TILE_FIELDS
    src_index = tl.load(row)
    s_off = tl.load(row + 1)
    s_stride = tl.load(row + 2)
    d_off = tl.load(row + 3) + dst_delta
    d_stride = tl.load(row + 4)
    nr = tl.load(row + 5)
    nc = tl.load(row + 6)
    if src_index < 0:
        aligned = ((d_off % VEC_D) == 0) & ((d_stride % VEC_D) == 0) & ((nc % VEC_D) == 0)
        if aligned:
            _fill_block(dst_ptr, d_off, d_stride, nr, nc, BLOCK_R, BLOCK_C, VEC_D, True)
        else:
            _fill_block(dst_ptr, d_off, d_stride, nr, nc, BLOCK_R, BLOCK_C, VEC_D, False)
    else:
        s_off += tl.load(info_ptr + src_index * 2)
        slot = tl.load(info_ptr + src_index * 2 + 1)
        if slot == 0:
            _copy_tile(src0, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                       BLOCK_R, BLOCK_C, VEC0, VEC_D, VMAX0)
        if N_SLOTS > 1:
            if slot == 1:
                _copy_tile(src1, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                           BLOCK_R, BLOCK_C, VEC1, VEC_D, VMAX1)
        if N_SLOTS > 2:
            if slot == 2:
                _copy_tile(src2, dst_ptr, s_off, s_stride, d_off, d_stride, nr, nc,
                           BLOCK_R, BLOCK_C, VEC2, VEC_D, VMAX2)


@dataclass(frozen=True)
class _Ptr:
    """Pointer-like argument Triton accepts in place of a tensor (it reads data_ptr() and dtype)."""
    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


def is_interpreted() -> bool:
    return not isinstance(_pieces_kernel, triton.runtime.JITFunction)


def _device_tiles(table: PieceTable, device: torch.device, block: int,
                  order: str | None = None) -> tuple[torch.Tensor, TilePlan]:
    cache = table.derived()
    order = order or TILE_ORDER
    key = ("tiles", str(device), block, order)
    if key not in cache:
        plan = plan_tiles(table.numpy(), block, FORCED_BLOCK_C, order=order)
        tiles = torch.from_numpy(plan.tiles).to(device)
        if tiles.is_cuda:  # built once per plan; make it visible to launches on any stream
            torch.cuda.current_stream(device).synchronize()
        cache[key] = (tiles, plan)
    return cache[key]


def _slot_bases(srcs: Sequence[torch.Tensor], meta: Sequence[SrcMeta], as_int: torch.dtype | None,
                compiled: bool):
    """Group sources by dtype: returns ([(base arg, VEC)] per slot, int64 [S, 2] (delta, slot))."""
    slots: dict[torch.dtype, list[int]] = {}
    for i, m in enumerate(meta):
        slots.setdefault(m.dtype, []).append(i)
    if len(slots) > MAX_SLOTS:  # unreachable while CAST_DTYPES has 3 entries; kept as a guard
        raise PieceTableError(f"at most {MAX_SLOTS} source dtypes per call, got {sorted(map(str, slots))}")
    ptrs = np.fromiter((m.data_ptr for m in meta), np.int64, len(meta))
    bases, info = [], np.zeros((len(meta), 2), np.int64)
    for k, (dtype, members) in enumerate(slots.items()):
        esize, load_dtype = dtype.itemsize, as_int or dtype
        idx = np.asarray(members)
        lowest = int(idx[np.argmin(ptrs[idx])])
        if compiled:  # rounded down to 16 bytes: still inside the same allocation, always aligned
            base_addr = meta[lowest].data_ptr & ~15
            base = _Ptr(base_addr, load_dtype)
        else:  # the interpreter needs a real tensor; alignment hints are no-ops there anyway
            base_addr, base = meta[lowest].data_ptr, srcs[lowest].view(load_dtype)
        delta = ptrs[idx] - base_addr
        if (delta % esize).any():
            bad = members[int(np.flatnonzero(delta % esize)[0])]
            raise PieceTableError(f"srcs[{bad}] data pointer is not aligned to its {esize}-byte elements")
        info[idx, 0] = delta // esize
        info[idx, 1] = k
        bases.append((base, 16 // esize))
    return bases, info


def check_device(dst: torch.Tensor) -> None:
    """The tensors the current Triton mode can address: CUDA compiled, CPU interpreted."""
    if not is_interpreted():
        if not dst.is_cuda:
            raise PieceTableError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    elif dst.device.type != "cpu":
        # The interpreter copies each argument to the host separately, so the other sources'
        # addresses (reached through base + delta) would not exist there.
        raise PieceTableError("under TRITON_INTERPRET=1 the Triton backend needs CPU tensors")


def execute_pieces_triton(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable,
                          block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS,
                          tile_order: str | None = None) -> None:
    """Execute the table with one Triton launch (none if it writes nothing)."""
    meta = validate_call(dst, srcs, table)
    check_device(dst)
    launch_pieces(dst, srcs, meta, table, block, num_warps, tile_order)


def bind_pieces(dst: torch.Tensor, srcs: Sequence[torch.Tensor], table: PieceTable,
                block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS, tile_order: str | None = None):
    """For benchmarks: all host work of execute_pieces_triton done once; returns a zero-argument
    function that only launches the kernel, so timing it measures the GPU's work alone. It holds
    raw addresses: valid only while these exact tensors stay alive and unmoved."""
    meta = validate_call(dst, srcs, table)
    check_device(dst)
    prepared = _prepare_launch(dst, srcs, meta, table, block, num_warps, tile_order)
    if prepared is None:
        return lambda: None
    kernel, args, kwargs = prepared

    def launch() -> None:
        kernel(*args, **kwargs)
    launch.tensors = (dst, list(srcs))  # held, so the addresses in args stay theirs
    return launch


def launch_pieces(dst: torch.Tensor, srcs: Sequence[torch.Tensor], meta: Sequence[SrcMeta], table: PieceTable,
                  block: int, num_warps: int, tile_order: str | None = None) -> None:
    """One launch for a validated call. DST_OFFSETs count elements from dst's first element and may
    reach past its end into other allocations of dst's dtype (execute_scatter rebases a group of
    destinations onto the lowest one this way); the caller has checked every write is in bounds."""
    prepared = _prepare_launch(dst, srcs, meta, table, block, num_warps, tile_order)
    if prepared is not None:
        kernel, args, kwargs = prepared
        kernel(*args, **kwargs)


def _raw_copy_type(dst: torch.Tensor, meta: Sequence[SrcMeta]) -> torch.dtype | None:
    """The integer type a pure copy moves bits as (every source has dst's dtype), None for a casting call."""
    if all(m.dtype == dst.dtype for m in meta):
        as_int = _INT_OF_SIZE.get(dst.element_size())
        if as_int is None:
            raise PieceTableError(f"dst dtype {dst.dtype} has no same-size integer type for a raw copy")
        return as_int
    if dst.dtype not in CAST_DTYPES:
        raise PieceTableError(f"dst dtype {dst.dtype}: casts are supported only among {CAST_DTYPES}")
    return None


def _prepare_launch(dst: torch.Tensor, srcs: Sequence[torch.Tensor], meta: Sequence[SrcMeta], table: PieceTable,
                    block: int, num_warps: int, tile_order: str | None):
    """Everything up to the launch: returns (kernel[grid], args, kwargs), or None if nothing is written.
    In compiled mode what depends on the sources alone (raw-copy type, slot bases, the device src_info
    table) is kept on the table for the latest call's exact sources (addresses, sizes, dtypes), dst dtype
    and stream: a sync repeats the same call every step, and rebuilding it for ~1000 sources (Python and
    numpy work plus a host-to-device copy) is host time on the critical path (docs/archive/results-2026-11.md, section
    29). Keyed on the stream, so a launch on another stream never reads a table whose copy was queued
    on a stream it is not ordered after. Interpreted mode keeps nothing (its bases are real tensors,
    which a cache would keep alive)."""
    compiled = not is_interpreted()
    key = hit = None
    if compiled:
        key = (tuple(meta), dst.dtype, str(dst.device), torch.cuda.current_stream(dst.device).cuda_stream)
        hit = table.derived().get("src_info")
        if hit is not None and hit[0] != key:
            hit = None
    as_int = hit[1] if hit is not None else _raw_copy_type(dst, meta)
    if as_int is not None:
        dst = dst.view(as_int)
    tiles, plan = _device_tiles(table, dst.device, block, tile_order)
    n_tiles = tiles.shape[0]
    if n_tiles == 0:
        return None
    if hit is not None:
        bases, info_dev = hit[2], hit[3]
    else:
        bases, info = _slot_bases(srcs, meta, as_int, compiled)
        info_dev = torch.from_numpy(info).to(dst.device, non_blocking=True) if len(meta) else None
        if compiled:
            table.derived()["src_info"] = (key, as_int, bases, info_dev)
    if info_dev is None:
        info_dev = tiles
    if compiled:
        dst_base = dst.data_ptr() & ~15
        dst_arg, dst_delta = _Ptr(dst_base, dst.dtype), (dst.data_ptr() - dst_base) // dst.element_size()
    else:
        dst_arg, dst_delta = dst, 0
    n_used = len(bases)
    bases = list(bases)  # the cached list stays as _slot_bases made it
    while len(bases) < MAX_SLOTS:  # unused slots: any pointer will do, they are compiled out
        bases.append((bases[0] if bases else (dst_arg, 16 // dst.element_size())))
    vec_d = 16 // dst.element_size()
    args = (tiles, info_dev, dst_arg, dst_delta, bases[0][0], bases[1][0], bases[2][0])
    kwargs = dict(N_SLOTS=n_used, VEC0=bases[0][1], VEC1=bases[1][1], VEC2=bases[2][1],
                  VEC_D=vec_d, VMAX0=max(bases[0][1], vec_d), VMAX1=max(bases[1][1], vec_d),
                  VMAX2=max(bases[2][1], vec_d), BLOCK_R=plan.block_r, BLOCK_C=plan.block_c,
                  TILE_FIELDS=TILE_FIELDS, num_warps=num_warps)
    return _pieces_kernel[(n_tiles,)], args, kwargs
