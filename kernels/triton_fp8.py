"""Triton executor for block-FP8 destinations: one program per destination block, one launch per call.

A program reads its block's block-table row (where the block's first weight byte and its scale live, its valid
rows/cols, its range of sub-pieces) and makes two passes over the block, STEP rows at a time: the first gathers
the block from its sub-pieces (each a masked 2-D load from one source, cast to float32) and takes the amax; the
second gathers it again (now from L2: a block is 32 KB of bf16), divides by scale = amax / 448 (IEEE division,
`div_rn`), clamps, rounds to e4m3fn on the bits and stores bytes. So one block's scale sees every piece of it,
whatever the pieces: fused qkv / gate_up parts and training-TP shards meeting inside one block. STEP rows at a
time keeps a [STEP, BK] float32 tile in registers instead of a whole 128x128 one.

Sources are reached as in triton_pieces (one base per source dtype plus a per-source element delta); the weights
of all FP8 destinations of a call are addressed from the lowest one (byte units), their scales from the lowest
scale (float32 units), the way execute_scatter rebases destinations of one dtype.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .fp8 import BLOCK_FIELDS, FP8_MAX, SUB_FIELDS
from .pieces import SrcMeta
from .triton_pieces import MAX_SLOTS, _Ptr, _slot_bases, is_interpreted

# Rows per pass step; the interpreter runs fastest with one step per block (fewer, larger numpy ops).
STEP_ROWS = int(os.environ.get("MTRAIN_FP8_STEP_ROWS", "32"))
WARPS = int(os.environ.get("MTRAIN_FP8_WARPS", "4"))
# Experimental, compiled mode only, off by default: round to e4m3 with the GPU's conversion (Triton's
# fp32 -> float8e4nv, round to nearest even) instead of _e4m3_bits' ~30 integer instructions per value. The kernel is
# issue bound (docs/results.md, "MoE bucket spread", FP8 part); this is for the H200 check, where bench_fp8_kernel.py
# verifies bit equality with the torch executor before timing. Never used by the interpreter.
HW_CVT = os.environ.get("MTRAIN_FP8_HW_CVT", "0") == "1"


@triton.jit
def _to_f32(vals):
    """bf16 widens by a 16-bit shift (exact in both modes); fp16/fp32 by Triton's exact conversion."""
    if vals.dtype == tl.bfloat16:
        return (vals.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return vals.to(tl.float32)


@triton.jit
def _e4m3_bits(x):
    """float32 in [-448, 448] -> float8_e4m3fn bits, round to nearest even, as c10's Float8_e4m3fn does
    (done on the bits so that the interpreter and the GPU agree with torch's cast exactly)."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Normal results (|x| >= 2**-6): keep 3 mantissa bits, rebias the exponent from 127 to 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal results: round |x| / 2**-9 to an integer (8 becomes 2**-6, the encoding carries on seamlessly).
    e = (a >> 23).to(tl.int32)
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.maximum(tl.minimum(141 - e, 25), 1).to(tl.uint32)
    sub = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    sub = tl.where(e == 0, 0, sub)
    bits = tl.where(a >= (121 << 23), normal, sub)
    return (bits | sign).to(tl.uint8)


@triton.jit
def _load_piece(src, so, ss, r0, c0, pnr, pnc, rows, c, VEC: tl.constexpr):
    """One sub-piece's part of the tile as float32 (zeros outside it) and its mask. When its offset, stride, first
    column and width are multiples of VEC (16 bytes of the source dtype), offsets are written as (x // VEC) * VEC and
    columns compared in units of VEC, so the compiler sees the alignment and issues 16-byte loads (triton_pieces
    does the same; tl.multiple_of on loaded scalars does not survive canonicalisation)."""
    if ((so % VEC) == 0) & ((ss % VEC) == 0) & ((c0 % VEC) == 0) & ((pnc % VEC) == 0):
        cv = c // VEC
        m = (rows >= r0) & (rows < r0 + pnr) & (cv >= c0 // VEC) & (cv < (c0 + pnc) // VEC)
        off = (so // VEC) * VEC + (rows - r0) * ((ss // VEC) * VEC) + (c - (c0 // VEC) * VEC)
        v = _to_f32(tl.load(src + off, mask=m, other=0))  # loaded in this branch: after the if, the
    else:  # merged offsets would carry the unaligned branch's (lack of) alignment
        m = (rows >= r0) & (rows < r0 + pnr) & (c >= c0) & (c < c0 + pnc)
        v = _to_f32(tl.load(src + (so + (rows - r0) * ss + (c - c0)), mask=m, other=0))
    return v, m


@triton.jit
def _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, r_lo, r, c,
            N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr,
            STEP: tl.constexpr, BK: tl.constexpr, FIELDS: tl.constexpr):
    """Rows [r_lo, r_lo + STEP) of the block as float32, from sub-pieces p0..p1 (zeros where none writes)."""
    acc = tl.zeros([STEP, BK], dtype=tl.float32)
    rows = r_lo + r
    for i in range(p0, p1):
        prow = sub_ptr + i * FIELDS
        si = tl.load(prow)
        if si >= 0:
            so = tl.load(prow + 1) + tl.load(info_ptr + si * 2)
            ss = tl.load(prow + 2)
            r0 = tl.load(prow + 3)
            c0 = tl.load(prow + 4)
            pnr = tl.load(prow + 5)
            pnc = tl.load(prow + 6)
            slot = tl.load(info_ptr + si * 2 + 1)
            v = tl.zeros([STEP, BK], dtype=tl.float32)
            m = (rows < 0) & (c < 0)  # all false
            if slot == 0:
                v, m = _load_piece(src0, so, ss, r0, c0, pnr, pnc, rows, c, VEC0)
            if N_SLOTS > 1:
                if slot == 1:
                    v, m = _load_piece(src1, so, ss, r0, c0, pnr, pnc, rows, c, VEC1)
            if N_SLOTS > 2:
                if slot == 2:
                    v, m = _load_piece(src2, so, ss, r0, c0, pnr, pnc, rows, c, VEC2)
            acc = tl.where(m, v, acc)  # a select, not an add: keeps the sign of -0.0
    return acc


@triton.jit
def _store_q(w_ptr, w_off, w_stride, nr, nc, rows, c, q, HW_CVT: tl.constexpr):
    """Store e4m3 bytes; 16-byte stores when the block's rows start at 16-byte multiples and it is whole 16s wide."""
    if HW_CVT:  # q is already clamped to [-448, 448]: no saturation case left
        bits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = _e4m3_bits(q)
    if ((w_off % 16) == 0) & ((w_stride % 16) == 0) & ((nc % 16) == 0):
        off = (w_off // 16) * 16 + rows * ((w_stride // 16) * 16) + c
        tl.store(w_ptr + off, bits, mask=(rows < nr) & ((c // 16) < (nc // 16)))
    else:
        tl.store(w_ptr + (w_off + rows * w_stride + c), bits, mask=(rows < nr) & (c < nc))


@triton.jit
def _fp8_blocks_kernel(blocks_ptr, sub_ptr, info_ptr, w_ptr, w_delta, s_ptr, s_delta, src0, src1, src2,
                       N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr,
                       FIELDS: tl.constexpr, SUBF: tl.constexpr, FMAX: tl.constexpr, HW_CVT: tl.constexpr):
    row = blocks_ptr + tl.program_id(0).to(tl.int64) * FIELDS
    w_off = tl.load(row) + w_delta
    s_off = tl.load(row + 1) + s_delta
    w_stride = tl.load(row + 2)
    nr = tl.load(row + 3)
    nc = tl.load(row + 4)
    p0 = tl.load(row + 5)
    p1 = tl.load(row + 6)
    r = tl.arange(0, STEP).to(tl.int64)[:, None]
    c = tl.arange(0, BK)[None, :]
    if STEP == BN:
        # The whole block in registers (STEP_ROWS = the block's rows): one gather, the amax and the quantization
        # from the same values, no second pass over the sources. Bit-equal to the two-pass path: the second
        # gather recomputes exactly these values.
        acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, 0, r, c, N_SLOTS, VEC0, VEC1, VEC2, STEP, BK,
                      SUBF)
        amax_s = tl.max(tl.max(tl.abs(acc), axis=1), axis=0)
        scale = tl.math.div_rn(amax_s, FMAX)
        tl.store(s_ptr + s_off, scale)
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.where(scale > 0, tl.math.div_rn(acc, safe + tl.zeros_like(acc)), acc * 0.0)
        q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
        _store_q(w_ptr, w_off, w_stride, nr, nc, r, c, q, HW_CVT)
    else:
        amax = tl.zeros([STEP, BK], dtype=tl.float32)
        for r_lo in tl.static_range(0, BN, STEP):
            acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, r_lo, r, c, N_SLOTS, VEC0, VEC1, VEC2, STEP,
                          BK, SUBF)
            amax = tl.maximum(amax, tl.abs(acc))
        amax_s = tl.max(tl.max(amax, axis=1), axis=0)
        scale = tl.math.div_rn(amax_s, FMAX)
        tl.store(s_ptr + s_off, scale)
        safe = tl.where(scale > 0, scale, 1.0)
        for r_lo in tl.static_range(0, BN, STEP):
            acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, r_lo, r, c, N_SLOTS, VEC0, VEC1, VEC2, STEP,
                          BK, SUBF)
            q = tl.where(scale > 0, tl.math.div_rn(acc, safe + tl.zeros_like(acc)), acc * 0.0)
            q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
            _store_q(w_ptr, w_off, w_stride, nr, nc, r_lo + r, c, q, HW_CVT)


def launch_fp8(w_anchor: torch.Tensor, s_anchor: torch.Tensor, w_delta: int, s_delta: int,
               blocks: torch.Tensor, subs: torch.Tensor, srcs: Sequence[torch.Tensor], meta: Sequence[SrcMeta],
               block: tuple[int, int], step: int | None = None, num_warps: int | None = None) -> None:
    """One launch over a call's FP8 blocks. `blocks`/`subs` are device int64 tables (fp8.plan_blocks, rebased:
    weight offsets in bytes from `w_anchor`, scale offsets in floats from `s_anchor`); w_delta/s_delta are added
    to them in the kernel (compiled mode addresses the anchors rounded down to 16 bytes)."""
    n_blocks = blocks.shape[0]
    if n_blocks == 0:
        return
    bn, bk = block
    if bk & (bk - 1) or bn & (bn - 1):
        raise ValueError(f"the Triton FP8 kernel needs power-of-two blocks, got {block}")
    compiled = not is_interpreted()
    step = min(step or (STEP_ROWS if compiled else bn), bn)
    bases, info = _slot_bases(srcs, meta, None, compiled)
    info_dev = torch.from_numpy(info).to(w_anchor.device, non_blocking=True) if len(meta) else blocks
    w8 = w_anchor.view(torch.uint8)
    if compiled:
        wb, sb = w8.data_ptr() & ~15, s_anchor.data_ptr() & ~15
        w_arg, s_arg = _Ptr(wb, torch.uint8), _Ptr(sb, torch.float32)
        w_delta += w8.data_ptr() - wb
        s_delta += (s_anchor.data_ptr() - sb) // 4
    else:
        w_arg, s_arg = w8, s_anchor
    n_used = len(bases)
    while len(bases) < MAX_SLOTS:  # unused slots are compiled out; any pointer will do
        bases.append(bases[0] if bases else (w_arg, 16))
    _fp8_blocks_kernel[(n_blocks,)](
        blocks, subs, info_dev, w_arg, w_delta, s_arg, s_delta, bases[0][0], bases[1][0], bases[2][0],
        N_SLOTS=max(n_used, 1), VEC0=bases[0][1], VEC1=bases[1][1], VEC2=bases[2][1], BN=bn, BK=bk, STEP=step, FIELDS=BLOCK_FIELDS, SUBF=SUB_FIELDS, FMAX=FP8_MAX,
        HW_CVT=HW_CVT and compiled, num_warps=num_warps or WARPS)


def rebase(parts: list[tuple[np.ndarray, np.ndarray]], w_ptrs: list[int], s_ptrs: list[int], src_maps: list):
    """Concatenate per-destination (blocks, subs) into one launch's tables, offsets rebased onto the lowest
    weight (bytes) and the lowest scale (floats); returns (blocks, subs, weight anchor index, scale anchor index)."""
    wa, sa = int(np.argmin(w_ptrs)), int(np.argmin(s_ptrs))
    all_b, all_s, n_sub = [], [], 0
    for (b, s), wp, sp, smap in zip(parts, w_ptrs, s_ptrs, src_maps):
        b = b.copy()
        b[:, 0] += wp - w_ptrs[wa]
        b[:, 1] += (sp - s_ptrs[sa]) // 4
        b[:, 5:7] += n_sub
        s = s.copy()
        live = s[:, 0] >= 0
        s[live, 0] = smap[s[live, 0]]
        all_b.append(b)
        all_s.append(s)
        n_sub += len(s)
    cat = lambda xs, f: np.concatenate(xs) if xs else np.zeros((0, f), np.int64)  # noqa: E731
    return cat(all_b, BLOCK_FIELDS), cat(all_s, SUB_FIELDS), wa, sa
