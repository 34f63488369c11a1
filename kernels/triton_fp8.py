"""Triton executor for block-FP8 destinations: one program per destination block (or, pipelined, a fixed number
of programs looping over them), a launch for the whole blocks and one for the rest.

A program reads its block's block-table row (where the block's first weight byte and its scale live, its valid
rows/cols, its range of sub-pieces), gathers the block from its sub-pieces (each a masked 2-D load from one source,
cast to float32), takes the amax, divides by scale = amax / 448 (the IEEE quotient: _quotient), rounds to e4m3fn
and stores bytes. So one block's scale sees every piece of it, whatever the pieces: fused qkv / gate_up parts and
training-TP shards meeting inside one block. By default (STEP_ROWS = 128) the whole block is gathered once into
registers; with fewer STEP rows a program makes two passes, the first for the amax, the second gathering again
(from L2: a block is 32 KB of bf16) to quantize, and keeps only a [STEP, BK] float32 tile in registers.

Most blocks of a large weight have one sub-piece covering them whole (plan_blocks' WHOLE flag). Those go through
a second compilation of the kernel, FAST: one 2-D load from that piece (masked only at the block's own edges), no
per-piece compares and selects, no sub-piece loop; the amax / scale / quantize / store code is the same.

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

from .fp8 import BLOCK_FIELDS, FP8_MAX, SUB_FIELDS, WHOLE
from .fp8_channel import FTZ_MIN, SCALE_MUL
from .pieces import SrcMeta
from .triton_pieces import MAX_SLOTS, _Ptr, _slot_bases, is_interpreted


def _knob(name: str, default: int, minimum: int) -> int:
    """An integer knob from the environment, refused at import with one line when it is not an integer >= minimum
    (PIPELINE=-1 would otherwise launch too few programs to cover the blocks)."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def _flag(name: str, default: bool) -> bool:
    """A 0/1 knob from the environment, refused at import with one line otherwise."""
    raw = os.environ.get(name, "1" if default else "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"


# The compiled kernel's knobs, defaults from the H200 sweep of 2026-12-01 (benchmarks/gpu_fp8_sweep.sh in git history, docs/archive/results-2026-11.md
# section 34; every variant bit-equal to the torch executor there): the whole 128-row block in registers (one gather,
# no second pass over the sources), 16 warps, and the GPU's own e4m3 conversion (cvt.rn.satfinite, round to nearest
# even, saturating: _e4m3x4) instead of _e4m3_bits' ~30 integer instructions per value: 2.1x (Llama-8B) and 2.1x
# (Qwen3-MoE) faster than the former 32 rows / 4 warps / bit rounding. The
# interpreter always takes one step per block and the bit rounding (it has no hardware conversion to match).
STEP_ROWS = _knob("MTRAIN_FP8_STEP_ROWS", 128, 1)
WARPS = _knob("MTRAIN_FP8_WARPS", 16, 1)
HW_CVT = _flag("MTRAIN_FP8_HW_CVT", True)
# Blocks one sub-piece covers whole (plan_blocks' WHOLE flag: every interior block of a large weight; all blocks of
# Llama-8B and Qwen3-MoE from training TP2) go through their own launch of the kernel compiled with FAST: one plain
# 2-D load, no per-piece masks or selects: 446 SASS instructions a thread for a bf16 block with 16-byte accesses at
# the defaults, against the general path's 871 (static counts for sm_90: benchmarks/fp8_kernel_ptx_count.py;
# docs/archive/results-2026-11.md section 36). 0 sends every block through the general path (to compare on the GPU).
FAST_PATH = _flag("MTRAIN_FP8_FAST", True)
# A register cap per thread (ptxas maxnreg), 64 by default (0: none). Uncapped, the fast path takes 92 registers at
# 16 warps, so one 512-thread program fills an SM's register file and an SM runs one block at a time: its loads,
# then its amax and division, then its stores, never overlapped with another block's. 64 lets two programs share an
# SM (72 bytes of spill: benchmarks/fp8_kernel_ptx_count.py --maxnreg 64). On the H200 (docs/archive/results-2026-11.md section 36)
# that took the kernel alone from 35 to 55 % of its floor with the per-element division, and from 46 to 76 %
# (Llama-8B) and 44 to 73 % (Qwen3-MoE) with the reciprocal one; 8 warps capped at 128 did the same.
MAXNREG = _knob("MTRAIN_FP8_MAXNREG", 64, 0) or None
# Division by the block's scale through its reciprocal and one exact correction (_quotient; the same bits as the
# IEEE division, 4 instructions an element instead of ~10) for bf16 and fp16 sources, where every case is checked
# (tests/kernels/test_fp8_rcp_div.py, on the CPU interpreter and the H200); float32 sources always divide.
# 0: every source divides (to compare on the GPU: 57 against 76 % of the floor, docs/archive/results-2026-11.md section 36).
RCP_DIV = _flag("MTRAIN_FP8_RCP_DIV", True)
RCP_DTYPES = (torch.bfloat16, torch.float16)
# Software pipelining of the whole blocks (0 by default: on the H200 it is exact but no faster, 71-78 % of the floor
# with N = 2 or 3 against 73-77 % without, docs/archive/results-2026-11.md section 38; kept for other GPUs). With N > 0 the fast path's
# launch is persistent: PROGRAMS_PER_SM programs on every SM each loop over blocks, and Triton's pipeliner (tl.range,
# num_stages=N) keeps N - 1 blocks' loads in flight (cp.async into shared memory, 32 KB of bf16 a stage) while the
# current block is quantized. What it is for: today an SM holds two programs that each alternate loading a block and
# quantizing it, so while both quantize nothing is in flight, about 32 KB of loads per SM on average against the ~42 KB
# the H200 needs in flight to stream at full bandwidth (docs/archive/results-2026-11.md section 36: the kernel at 73-77 % of its floor).
# Static counts (benchmarks/fp8_kernel_ptx_count.py --pipeline N): N = 2 or 3 take 93-95 registers and no spill uncapped
# (MTRAIN_FP8_MAXNREG=0: one program per SM), 64 with 112 bytes of spill at the default cap. Only for launches whose
# loads and stores need no branch: whole blocks, one source dtype, every source offset, stride and width and every
# weight row 16-byte aligned (else the one-block-per-program launch, as with 0).
PIPELINE = _knob("MTRAIN_FP8_PIPELINE", 0, 0)
# programs that share an SM's 64K registers at the register cap (uncapped: up to 128 a thread at 16 warps, one)
PROGRAMS_PER_SM = max(1, 65536 // (32 * WARPS * (MAXNREG or 128)))


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
def _load_piece(src, so, ss, r0, c0, pnr, pnc, rows, c, VEC: tl.constexpr, AT_ORIGIN: tl.constexpr,
                ALIGNED: tl.constexpr):
    """One sub-piece's part of the tile as float32 (zeros outside it) and its mask. When its offset, stride, first
    column and width are multiples of VEC (16 bytes of the source dtype), offsets are written as (x // VEC) * VEC and
    columns compared in units of VEC, so the compiler sees the alignment and issues 16-byte loads (triton_pieces
    does the same; tl.multiple_of on loaded scalars does not survive canonicalisation). AT_ORIGIN: the piece starts
    at the block's row 0, column 0 (the fast path passes literal zeros), so only its far edges are compared.
    ALIGNED: the host has checked that alignment for every block of the launch, so there is no runtime test (and
    the load is not inside a branch, which the pipelined launch needs)."""
    # Row and column conditions are combined last: each is a [STEP, 1] or [1, BK] vector until then.
    mr = rows < r0 + pnr
    if not AT_ORIGIN:
        mr = mr & (rows >= r0)
    if ALIGNED:
        v, m = _load_vec(src, so, ss, r0, c0, pnc, rows, c, mr, VEC, AT_ORIGIN)
    elif ((so % VEC) == 0) & ((ss % VEC) == 0) & ((c0 % VEC) == 0) & ((pnc % VEC) == 0):
        v, m = _load_vec(src, so, ss, r0, c0, pnc, rows, c, mr, VEC, AT_ORIGIN)  # loaded in this branch: after
    else:  # the if, the merged offsets would carry the unaligned branch's (lack of) alignment
        mc = c < c0 + pnc
        if not AT_ORIGIN:
            mc = mc & (c >= c0)
        m = mr & mc
        v = _to_f32(tl.load(src + (so + (rows - r0) * ss + (c - c0)), mask=m, other=0))
    return v, m


@triton.jit
def _load_vec(src, so, ss, r0, c0, pnc, rows, c, mr, VEC: tl.constexpr, AT_ORIGIN: tl.constexpr):
    """_load_piece's 16-byte variant: offset, stride, first column and width are multiples of VEC."""
    cv = c // VEC
    mc = cv < (c0 + pnc) // VEC
    if not AT_ORIGIN:
        mc = mc & (cv >= c0 // VEC)
    m = mr & mc
    off = (so // VEC) * VEC + (rows - r0) * ((ss // VEC) * VEC) + (c - (c0 // VEC) * VEC)
    return _to_f32(tl.load(src + off, mask=m, other=0)), m


@triton.jit
def _load_slot(src0, src1, src2, slot, so, ss, r0, c0, pnr, pnc, rows, c, N_SLOTS: tl.constexpr,
               VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr, STEP: tl.constexpr, BK: tl.constexpr,
               AT_ORIGIN: tl.constexpr, ALIGNED: tl.constexpr):
    """_load_piece from the source base of the piece's dtype slot (unused slots are compiled out; with one source
    dtype, the sync's usual case, so are the slot test and the zeros it needs for the no-slot case)."""
    if N_SLOTS == 1:
        return _load_piece(src0, so, ss, r0, c0, pnr, pnc, rows, c, VEC0, AT_ORIGIN, ALIGNED)
    v = tl.zeros([STEP, BK], dtype=tl.float32)
    m = (rows < 0) & (c < 0)  # all false
    if slot == 0:
        v, m = _load_piece(src0, so, ss, r0, c0, pnr, pnc, rows, c, VEC0, AT_ORIGIN, ALIGNED)
    if N_SLOTS > 1:
        if slot == 1:
            v, m = _load_piece(src1, so, ss, r0, c0, pnr, pnc, rows, c, VEC1, AT_ORIGIN, ALIGNED)
    if N_SLOTS > 2:
        if slot == 2:
            v, m = _load_piece(src2, so, ss, r0, c0, pnr, pnc, rows, c, VEC2, AT_ORIGIN, ALIGNED)
    return v, m


@triton.jit
def _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, nr, nc, r_lo, r, c,
            N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr,
            STEP: tl.constexpr, BK: tl.constexpr, FIELDS: tl.constexpr, FAST: tl.constexpr, ALIGNED: tl.constexpr):
    """Rows [r_lo, r_lo + STEP) of the block as float32, from sub-pieces p0..p1 (zeros where none writes).
    FAST: the block's one sub-piece (p0) covers it whole (plan_blocks' flag), so its rows x cols are the block's
    nr x nc from (0, 0): one load masked at the block's own edges, no per-piece compares, no select."""
    rows = r_lo + r
    if FAST:
        prow = sub_ptr + p0 * FIELDS
        si = tl.load(prow)
        so = tl.load(prow + 1) + tl.load(info_ptr + si * 2)
        ss = tl.load(prow + 2)
        acc, _ = _load_slot(src0, src1, src2, tl.load(info_ptr + si * 2 + 1), so, ss, 0, 0, nr, nc, rows, c,
                            N_SLOTS, VEC0, VEC1, VEC2, STEP, BK, True, ALIGNED)  # zeros outside: other=0
    else:
        acc = tl.zeros([STEP, BK], dtype=tl.float32)
        for i in range(p0, p1):
            prow = sub_ptr + i * FIELDS
            si = tl.load(prow)
            if si >= 0:
                so = tl.load(prow + 1) + tl.load(info_ptr + si * 2)
                v, m = _load_slot(src0, src1, src2, tl.load(info_ptr + si * 2 + 1), so, tl.load(prow + 2),
                                  tl.load(prow + 3), tl.load(prow + 4), tl.load(prow + 5), tl.load(prow + 6), rows, c,
                                  N_SLOTS, VEC0, VEC1, VEC2, STEP, BK, False, False)
                acc = tl.where(m, v, acc)  # a select, not an add: keeps the sign of -0.0
    return acc


@triton.jit
def _quotient(acc, scale, FMAX: tl.constexpr, RCP_DIV: tl.constexpr, HW_CVT: tl.constexpr):
    """float32(acc / scale) for every element (IEEE quotient, round to nearest even; scale 0 or NaN: signed zeros),
    clamped to [-FMAX, FMAX] unless HW_CVT's conversion saturates by itself (cvt.rn.satfinite: the same result for
    every finite value, and NaN stays NaN as in torch's clamp instead of becoming -448).
    RCP_DIV: the block's reciprocal r = 1/scale is taken once, and each element costs a multiply, two FMAs and a
    sign step: q0 = x*r, rem = x - scale*q0 (exact), q = q0 + rem*r. That is the correction step of the GPU's own
    div.rn (whose fast path recomputes the reciprocal per element and then checks the operands, ~10 instructions an
    element instead of 4); it equals the IEEE quotient bit for bit for 8- and 11-bit-mantissa sources (bf16, fp16)
    whenever the scale lies in [2**-100, 2**100] (exhaustive check over every mantissa pair:
    tests/kernels/test_fp8_rcp_div.py; exponents only shift the operands there). Outside that range (no real weight
    block) the block divides as before.
    An x of -0.0 comes out +0 from these steps (and a formulation that keeps the sign through negated operands is
    not safe: the compiler moves FMA negations, which the H200 run showed as -0.0 -> 0x00), so x's sign bit is ORed
    into the result, an integer step the compiler leaves alone."""
    if RCP_DIV:
        fits = (scale >= 7.888609052210118e-31) & (scale <= 1.2676506002282294e30)  # 2**-100, 2**100
        if fits:
            r = tl.math.div_rn(1.0, scale)
            q0 = acc * r
            q = tl.fma(tl.fma(-scale, q0, acc), r, q0)  # the remainder x - scale*q0 is exact
            # x = -0.0 gives +0 above; the quotient's sign is x's (scale > 0): OR x's sign bit in (one LOP3)
            sign = acc.to(tl.uint32, bitcast=True) & 0x80000000
            q = (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        else:
            q = _divide(acc, scale)
    else:
        q = _divide(acc, scale)
    if not HW_CVT:
        q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    return q


@triton.jit
def _divide(acc, scale):
    """The IEEE quotient per element (div_rn); scale 0 or NaN gives signed zeros (x * 0.0), as the reference."""
    safe = tl.where(scale > 0, scale, 1.0)
    return tl.where(scale > 0, tl.math.div_rn(acc, safe + tl.zeros_like(acc)), acc * 0.0)


@triton.jit
def _channel_scale_q(acc, SCALE_MUL: tl.constexpr, FTZ_MIN: tl.constexpr, FMAX: tl.constexpr, HW_RCP: tl.constexpr,
                     HW_CVT: tl.constexpr):
    """Per-channel FP8 of one row (fp8_channel.py: SGLang's sm90 per-token kernel, step by step): float32 denormals
    flushed to signed zero, scale = amax * float32(1/448) (flushed), inv = its reciprocal (rcp.approx.ftz.f32, the
    kernel's MUFU.RCP, on the GPU; the IEEE one in the interpreter), q = x * inv; a zero scale gives inv 0 (signed
    zeros). Returns (scale, q)."""
    x = tl.where(tl.abs(acc) < FTZ_MIN, acc * 0.0, acc)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = amax * SCALE_MUL
    scale = tl.where(scale < FTZ_MIN, 0.0, scale)
    if HW_RCP:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [scale], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        r = tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0))
    q = x * tl.where(scale > 0, r, 0.0)
    if not HW_CVT:
        q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    return scale, q


@triton.jit
def _e4m3x4(q):
    """float32 -> e4m3 bytes by the GPU's cvt.rn.satfinite.e4m3x2.f32, four values into one 32-bit register (the
    first in the low byte, as Triton packs): two conversions and one move. Triton's own `.to(tl.float8e4nv)` emits
    the same conversions but then splits each pair into bytes and joins them again (~3.5 more instructions a value)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [q], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _store_q(w_ptr, w_off, w_stride, nr, nc, rows, c, q, HW_CVT: tl.constexpr, ALIGNED: tl.constexpr):
    """Store e4m3 bytes; 16-byte stores when the block's rows start at 16-byte multiples and it is whole 16s wide
    (ALIGNED: the host has checked that for every block of the launch; no runtime test)."""
    if HW_CVT:  # saturating conversion (cvt.rn.satfinite): q needs no clamp
        bits = _e4m3x4(q)
    else:
        bits = _e4m3_bits(q)
    if ALIGNED:
        _store16(w_ptr, w_off, w_stride, nr, nc, rows, c, bits)
    elif ((w_off % 16) == 0) & ((w_stride % 16) == 0) & ((nc % 16) == 0):
        _store16(w_ptr, w_off, w_stride, nr, nc, rows, c, bits)
    else:
        tl.store(w_ptr + (w_off + rows * w_stride + c), bits, mask=(rows < nr) & (c < nc))


@triton.jit
def _store16(w_ptr, w_off, w_stride, nr, nc, rows, c, bits):
    """_store_q's 16-byte variant (offsets written as multiples of 16 so that the compiler sees the alignment)."""
    off = (w_off // 16) * 16 + rows * ((w_stride // 16) * 16) + c
    tl.store(w_ptr + off, bits, mask=(rows < nr) & ((c // 16) < (nc // 16)))


@triton.jit
def _fp8_blocks_kernel(blocks_ptr, sub_ptr, info_ptr, w_ptr, w_delta, s_ptr, s_delta, src0, src1, src2, n_blocks,
                       N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr, FIELDS: tl.constexpr,
                       SUBF: tl.constexpr, FMAX: tl.constexpr, HW_CVT: tl.constexpr, FAST: tl.constexpr,
                       RCP_DIV: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr,
                       CHANNEL: tl.constexpr = False, HW_RCP: tl.constexpr = False,
                       SCALE_MUL: tl.constexpr = 0.0, FTZ_MIN: tl.constexpr = 0.0):
    """One block per program (STAGES = 0), or a fixed number of programs each looping over blocks with Triton's
    pipeliner loading the next block (asynchronously, into shared memory) while this one is quantized (STAGES > 0:
    `num_stages`; only for launches whose loads need no branch: FAST, ALIGNED, one source dtype)."""
    if STAGES > 0:
        for b in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            _quantize_block(b, blocks_ptr, sub_ptr, info_ptr, w_ptr, w_delta, s_ptr, s_delta, src0, src1, src2,
                            N_SLOTS, VEC0, VEC1, VEC2, BN, BK, STEP, FIELDS, SUBF, FMAX, HW_CVT, FAST, RCP_DIV,
                            ALIGNED, CHANNEL, HW_RCP, SCALE_MUL, FTZ_MIN)
    else:
        _quantize_block(tl.program_id(0), blocks_ptr, sub_ptr, info_ptr, w_ptr, w_delta, s_ptr, s_delta, src0, src1,
                        src2, N_SLOTS, VEC0, VEC1, VEC2, BN, BK, STEP, FIELDS, SUBF, FMAX, HW_CVT, FAST, RCP_DIV,
                        ALIGNED, CHANNEL, HW_RCP, SCALE_MUL, FTZ_MIN)


@triton.jit
def _quantize_block(b, blocks_ptr, sub_ptr, info_ptr, w_ptr, w_delta, s_ptr, s_delta, src0, src1, src2,
                    N_SLOTS: tl.constexpr, VEC0: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr, FIELDS: tl.constexpr, SUBF: tl.constexpr,
                    FMAX: tl.constexpr, HW_CVT: tl.constexpr, FAST: tl.constexpr, RCP_DIV: tl.constexpr,
                    ALIGNED: tl.constexpr, CHANNEL: tl.constexpr, HW_RCP: tl.constexpr, SCALE_MUL: tl.constexpr,
                    FTZ_MIN: tl.constexpr):
    """Block b of the table: gather, amax, scale, quantize, store. CHANNEL: the block is one row (BN = STEP = 1,
    BK its width rounded up to a power of two) under the per-channel math (_channel_scale_q)."""
    row = blocks_ptr + tl.cast(b, tl.int64) * FIELDS  # tl.cast: b is a Python int in the interpreter's tl.range
    w_off = tl.load(row) + w_delta
    s_off = tl.load(row + 1) + s_delta
    w_stride = tl.load(row + 2)
    nr = tl.load(row + 3)
    nc = tl.load(row + 4)
    p0 = tl.load(row + 5)
    p1 = tl.load(row + 6)
    r = tl.arange(0, STEP).to(tl.int64)[:, None]
    c = tl.arange(0, BK)[None, :]
    if CHANNEL:
        acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, nr, nc, 0, r, c, N_SLOTS, VEC0, VEC1, VEC2, STEP,
                      BK, SUBF, FAST, ALIGNED)
        scale, q = _channel_scale_q(acc, SCALE_MUL, FTZ_MIN, FMAX, HW_RCP, HW_CVT)
        tl.store(s_ptr + s_off, scale)
        _store_q(w_ptr, w_off, w_stride, nr, nc, r, c, q, HW_CVT, ALIGNED)
    elif STEP == BN:
        # The whole block in registers (STEP_ROWS = the block's rows): one gather, the amax and the quantization
        # from the same values, no second pass over the sources. Bit-equal to the two-pass path: the second
        # gather recomputes exactly these values.
        acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, nr, nc, 0, r, c, N_SLOTS, VEC0, VEC1, VEC2, STEP,
                      BK, SUBF, FAST, ALIGNED)
        amax_s = tl.max(tl.max(tl.abs(acc), axis=1), axis=0)
        scale = tl.math.div_rn(amax_s, FMAX)
        tl.store(s_ptr + s_off, scale)
        _store_q(w_ptr, w_off, w_stride, nr, nc, r, c, _quotient(acc, scale, FMAX, RCP_DIV, HW_CVT), HW_CVT,
                 ALIGNED)
    else:
        amax = tl.zeros([STEP, BK], dtype=tl.float32)
        for r_lo in tl.static_range(0, BN, STEP):
            acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, nr, nc, r_lo, r, c, N_SLOTS, VEC0, VEC1, VEC2,
                          STEP, BK, SUBF, FAST, ALIGNED)
            amax = tl.maximum(amax, tl.abs(acc))
        amax_s = tl.max(tl.max(amax, axis=1), axis=0)
        scale = tl.math.div_rn(amax_s, FMAX)
        tl.store(s_ptr + s_off, scale)
        for r_lo in tl.static_range(0, BN, STEP):
            acc = _gather(sub_ptr, info_ptr, src0, src1, src2, p0, p1, nr, nc, r_lo, r, c, N_SLOTS, VEC0, VEC1, VEC2,
                          STEP, BK, SUBF, FAST, ALIGNED)
            _store_q(w_ptr, w_off, w_stride, nr, nc, r_lo + r, c, _quotient(acc, scale, FMAX, RCP_DIV, HW_CVT),
                     HW_CVT, ALIGNED)


def _programs(device: torch.device, compiled: bool) -> int:
    """Programs of a pipelined launch: PROGRAMS_PER_SM on every SM (the interpreter: 3, so that each loops)."""
    if not compiled:
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def launch_fp8(w_anchor: torch.Tensor, s_anchor: torch.Tensor, w_delta: int, s_delta: int,
               blocks: torch.Tensor, subs: torch.Tensor, srcs: Sequence[torch.Tensor], meta: Sequence[SrcMeta],
               block: tuple[int, int], step: int | None = None, num_warps: int | None = None,
               n_whole: int = 0, aligned_whole: bool = False, channel: bool = False) -> list:
    """The launches over a call's FP8 blocks. `blocks`/`subs` are device int64 tables (fp8.plan_blocks, rebased:
    weight offsets in bytes from `w_anchor`, scale offsets in floats from `s_anchor`); w_delta/s_delta are added
    to them in the kernel (compiled mode addresses the anchors rounded down to 16 bytes). The first `n_whole`
    blocks are WHOLE ones (rebase puts them first): one launch of the fast path for them, one of the general path
    for the rest. Two launches rather than a per-block branch in one: each kernel is compiled for one path (the
    fast one without the general path's registers and code), and the second launch costs microseconds, against
    milliseconds for a sync's worth of blocks. `aligned_whole`: the caller has checked whole_blocks_aligned and
    that every source and the weight anchor are 16-byte aligned, which the pipelined launch (PIPELINE) needs.
    `channel`: per-channel FP8 (fp8_channel.py), block (1, cols): one row a program, its tile the row's width rounded
    up to a power of two (the loads and stores are masked at the real width).
    Returns the launches it ran, [(kernel[grid], args, kwargs)], for
    the caller to replay while nothing changes (scatter_fp8)."""
    n_blocks = blocks.shape[0]
    if n_blocks == 0:
        return []
    bn, bk = block
    if channel:
        if bn != 1:
            raise ValueError(f"per-channel FP8 takes blocks of one row, got {block}")
        bk = triton.next_power_of_2(bk)
    elif bk & (bk - 1) or bn & (bn - 1):
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
    n_whole = n_whole if FAST_PATH else 0
    rcp_div = RCP_DIV and all(m.dtype in RCP_DTYPES for m in meta)
    # The whole blocks' launch is pipelined when asked for and its loads need no branch (module comment, PIPELINE)
    pipelined = bool(PIPELINE) and aligned_whole and n_used == 1 and step == bn and not channel
    # a row of up to 2**13 columns at 8 per thread in 4-byte registers, the block math's WARPS otherwise
    warps = num_warps or (max(1, min(WARPS, bk // 256)) if channel else WARPS)
    launches = []
    for fast, part in ((True, blocks[:n_whole]), (False, blocks[n_whole:])):
        if part.shape[0]:
            stages = PIPELINE if fast and pipelined else 0
            grid = min(part.shape[0], _programs(w_anchor.device, compiled)) if stages else part.shape[0]
            launches.append((_fp8_blocks_kernel[(grid,)],
                             (part, subs, info_dev, w_arg, w_delta, s_arg, s_delta, bases[0][0], bases[1][0],
                              bases[2][0], part.shape[0]),
                             dict(N_SLOTS=max(n_used, 1), VEC0=bases[0][1], VEC1=bases[1][1], VEC2=bases[2][1], BN=bn,
                                  BK=bk, STEP=step, FIELDS=BLOCK_FIELDS, SUBF=SUB_FIELDS, FMAX=FP8_MAX,
                                  HW_CVT=HW_CVT and compiled, FAST=fast, RCP_DIV=rcp_div, ALIGNED=bool(stages),
                                  STAGES=stages, CHANNEL=channel, HW_RCP=channel and compiled,
                                  SCALE_MUL=SCALE_MUL, FTZ_MIN=FTZ_MIN, num_warps=warps,
                                  **({"maxnreg": MAXNREG} if MAXNREG and compiled else {}))))
    for kernel, args, kwargs in launches:
        kernel(*args, **kwargs)
    return launches


def rebase(parts: list[tuple[np.ndarray, np.ndarray]], w_ptrs: list[int], s_ptrs: list[int], src_maps: list):
    """Concatenate per-destination (blocks, subs) into one call's tables, offsets rebased onto the lowest
    weight (bytes) and the lowest scale (floats), WHOLE blocks first (launch_fp8's n_whole: their count); returns
    (blocks, subs, weight anchor index, scale anchor index)."""
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
    blocks = cat(all_b, BLOCK_FIELDS)
    # a program owns its block and finds its sub-pieces by index: blocks reorder freely (stable: same order else)
    return blocks[np.argsort(-blocks[:, WHOLE], kind="stable")], cat(all_s, SUB_FIELDS), wa, sa


def whole_blocks_aligned(blocks: np.ndarray, subs: np.ndarray, n_whole: int, vecs: np.ndarray) -> bool:
    """Whether every one of the first n_whole (whole) blocks of rebased tables reads its sub-piece at a source offset,
    row stride and width that are multiples of its source's VEC (vecs[source index]: 16 bytes in elements) and
    writes rows starting at 16-byte multiples (offsets from the weight anchor, row stride, width in bytes). With every
    source and the weight anchor 16-byte aligned, that is launch_fp8's `aligned_whole`."""
    if n_whole == 0:
        return False
    b = blocks[:n_whole]
    sub = subs[b[:, 5]]
    vec = vecs[sub[:, 0]]
    src_ok = (sub[:, 1] % vec == 0) & (sub[:, 2] % vec == 0) & (b[:, 4] % vec == 0)
    dst_ok = (b[:, 0] % 16 == 0) & (b[:, 2] % 16 == 0) & (b[:, 4] % 16 == 0)
    return bool((src_ok & dst_ok).all())
