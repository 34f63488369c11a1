"""Block-wise FP8 destinations: quantize while scattering (DeepSeek's 128x128 format, as SGLang stores it).

A `BlockFp8` destination is a float8_e4m3fn weight of shape [rows, cols] (or [slots, rows, cols]: SGLang's
FusedMoE w13/w2) plus its float32 `weight_scale_inv` [slots,] ceil(rows/bn) x ceil(cols/bk). For each block
    scale = amax(|block|) / 448          (float32, IEEE division; the block's real elements only: edge blocks
                                          of a size not divisible by the block are partial, as in SGLang)
    q     = fp8_e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even; x / 0 -> signed zero)
and SGLang dequantizes w = q * scale (`fp8_utils.py` block_quant_dequant). Blocks never straddle slots.

The pieces of a scatter table that write an FP8 destination are in that destination's element units (1 byte),
as for any destination. The host turns them into per-block sub-pieces (`plan_blocks`): a destination block may
gather from several pieces (fused qkv / gate_up, several training TP shards), and its one scale must be the amax
over all of them, so every program of the Triton kernel owns whole destination blocks: it gathers a block from
its sub-pieces, takes the amax, then quantizes and stores. Every block a table touches must be covered whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .fp8_format import FP8, FP8_MAX  # noqa: F401 (re-exported: the format's constants, declared once)
from .pieces import (DST_OFFSET, DST_STRIDE, FILL, NCOLS, NROWS, SRC_INDEX, SRC_OFFSET, SRC_STRIDE, PieceTable,
                     PieceTableError, copy_pieces_torch)

DEFAULT_BLOCK = (128, 128)
SCALINGS = ("block", "channel")  # BlockFp8.scaling
SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a block-FP8 destination can be fed
# block table: w_off, scale_off, row stride, nrows, ncols, first sub-piece, end, whole (1: the block's one sub-piece,
# from a source, covers it: the interior blocks of a large weight, which the Triton kernel's fast path loads in one
# plain 2-D load; 0: several sub-pieces or a zero fill, the general path)
BLOCK_FIELDS = 8
WHOLE = 7
SUB_FIELDS = 8  # sub-piece table: src_index, src_offset, src_stride, row0, col0, nrows, ncols, 0 (rows/cols in block)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, ...]:
    """SGLang's weight_scale_inv shape for a weight of `shape` ([N, K] or [E, N, K])."""
    bn, bk = block
    return tuple(shape[:-2]) + (-(-shape[-2] // bn), -(-shape[-1] // bk))


@dataclass(frozen=True)
class BlockFp8:
    """How execute_scatter writes one destination as block FP8: `scale` is its flat float32 scale tensor,
    `shape` the weight's real shape ([N, K] or [E, N, K]), `block` (rows, cols) of one scale block."""

    scale: torch.Tensor
    shape: tuple[int, ...]
    block: tuple[int, int] = DEFAULT_BLOCK
    # "block": DeepSeek's amax/448 block math; "channel": SGLang's own per-row quantization of a bf16 weight
    # (fp8_channel.py), on block (1, cols): a destination row is one scale group
    scaling: str = "block"

    @property
    def geometry(self) -> tuple[int, int, int]:
        """(slots, rows per slot, cols)."""
        if len(self.shape) == 2:
            return 1, int(self.shape[0]), int(self.shape[1])
        if len(self.shape) == 3:
            return int(self.shape[0]), int(self.shape[1]), int(self.shape[2])
        raise PieceTableError(f"a block-FP8 destination must be 2-D or 3-D, got shape {tuple(self.shape)}")

    def check(self, name: str, dst: torch.Tensor) -> None:
        """The destination and its scale fit this spec (shape, dtypes, contiguity); raises PieceTableError."""
        slots, rows, cols = self.geometry
        bn, bk = self.block
        if bn <= 0 or bk <= 0:
            raise PieceTableError(f"{name}: block sizes must be positive, got {self.block}")
        if self.scaling not in SCALINGS:
            raise PieceTableError(f"{name}: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling == "channel" and (len(self.shape) != 2 or tuple(self.block) != (1, cols)):
            raise PieceTableError(f"{name}: per-channel FP8 needs a 2-D weight and block (1, cols), got shape "
                                  f"{tuple(self.shape)} and block {tuple(self.block)}")
        if dst.dtype != FP8:
            raise PieceTableError(f"{name}: a block-FP8 destination must be {FP8}, got {dst.dtype}")
        if dst.numel() != slots * rows * cols:
            raise PieceTableError(f"{name}: {dst.numel()} elements but the FP8 spec says shape {tuple(self.shape)}")
        s = self.scale
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1 or not s.is_contiguous():
            raise PieceTableError(f"{name}: the scale must be a flat contiguous float32 tensor, got "
                                  f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
        want = int(np.prod(scale_shape(tuple(self.shape), self.block)))
        if s.numel() != want:
            raise PieceTableError(f"{name}: the scale has {s.numel()} elements, a {tuple(self.shape)} weight in "
                                  f"{bn}x{bk} blocks needs {scale_shape(tuple(self.shape), self.block)}")
        if s.device != dst.device:
            raise PieceTableError(f"{name}: the scale is on {s.device}, the weight on {dst.device}")


# ---------------------------------------------------------------------------------------------------------------
# The math, in torch (the torch executor, offline quantization of a checkpoint, tests' second opinion).

def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize w ([N, K] or [E, N, K], any float dtype) -> (float8_e4m3fn like w, float32 scale_inv)."""
    bn, bk = block
    x = w.detach().to(torch.float32)
    lead, (n, k) = x.shape[:-2], x.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=x.device)
    pad[..., :n, :k] = x
    blocks = pad.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    # A tensor divisor, never the Python float: CUDA torch turns `tensor / cpu_scalar` into tensor * (1/scalar)
    # (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), which is one ulp off amax/448 for about half of all
    # blocks; the format (and the Triton kernel's div_rn) is the IEEE quotient, on every device.
    scale = amax / torch.full_like(amax, FP8_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, blocks / safe, blocks * 0.0).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * bn, kb * bk)[..., :n, :k].to(FP8)
    return q.contiguous(), scale.view(*lead, nb, kb).contiguous()


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """q * scale per block, in float32 (what SGLang's block_quant_dequant computes)."""
    bn, bk = block
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return q.to(torch.float32) * s


# ---------------------------------------------------------------------------------------------------------------
# Host planning: pieces of one destination -> per-block sub-pieces.

def _rects(rows: np.ndarray, ids: np.ndarray, total_rows: int, cols: int, name: str) -> np.ndarray:
    """Pieces -> 2-D rectangles of the destination seen as [total_rows, cols]: int64 [M, 7] =
    (src_index, src_offset, src_stride, row0, col0, nrows, ncols). A piece is either a rectangle with row stride
    `cols`, or a contiguous run (one row, or rows packed back to back on both sides) that may wrap rows."""
    si, so, ss, do, ds, nr, nc = (rows[:, i] for i in (SRC_INDEX, SRC_OFFSET, SRC_STRIDE, DST_OFFSET, DST_STRIDE,
                                                         NROWS, NCOLS))
    live = (nr > 0) & (nc > 0)
    run = live & ((nr == 1) | ((ds == nc) & ((ss == nc) | (si == FILL))))
    rect = live & ~run & (ds == cols) & ((do % cols) + nc <= cols)
    bad = np.flatnonzero(live & ~run & ~rect)
    if bad.size:
        k = int(bad[0])
        raise PieceTableError(f"{name}: piece {int(ids[k])} ({rows[k].tolist()}) is not a rectangle of the FP8 "
                              f"destination's [{total_rows}, {cols}] rows (row stride {cols}) nor a contiguous run")
    out = [np.stack([si[rect], so[rect], ss[rect], do[rect] // cols, do[rect] % cols, nr[rect], nc[rect]], 1)]
    # Runs: a head (rest of the first row), whole rows, a tail (start of the last row); each a rectangle.
    length, start, s0, sidx = (nr * nc)[run], do[run], so[run], si[run]
    c0 = start % cols
    head = np.minimum(length, np.where(c0 > 0, cols - c0, 0))
    full = (length - head) // cols
    tail = length - head - full * cols
    r_head = start // cols
    r_full = r_head + (head > 0)
    for keep, r, c, n, w, off in ((head > 0, r_head, c0, 1, head, s0),
                                  (full > 0, r_full, 0, full, cols, s0 + head),
                                  (tail > 0, r_full + full, 0, 1, tail, s0 + head + full * cols)):
        n, c, w = (np.broadcast_to(np.asarray(v, np.int64), keep.shape) for v in (n, c, w))
        out.append(np.stack([sidx[keep], off[keep], np.full(int(keep.sum()), cols, np.int64), r[keep],
                             c[keep], n[keep], w[keep]], 1))
    return np.concatenate(out).astype(np.int64).reshape(-1, 7)


def _split(lo: np.ndarray, n: np.ndarray, block_of, block_start, block_end):
    """Cut intervals [lo, lo+n) at block boundaries: (owner index, block id, start, length) per segment."""
    g0, g1 = block_of(lo), block_of(lo + n - 1)
    count = g1 - g0 + 1
    owner = np.repeat(np.arange(len(lo)), count)
    g = np.repeat(g0, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    start = np.maximum(lo[owner], block_start(g))
    end = np.minimum(lo[owner] + n[owner], block_end(g))
    return owner, g, start, end - start


def plan_blocks(rows: np.ndarray, ids: np.ndarray, spec: BlockFp8, name: str = "dst"):
    """One destination's pieces -> (blocks int64 [B, 8], sub-pieces int64 [P, 8]); offsets relative to the
    destination's own weight and scale. Raises PieceTableError if a touched block is not covered whole."""
    slots, nrows, ncols = spec.geometry
    bn, bk = spec.block
    nbr, nbc = -(-nrows // bn), -(-ncols // bk)
    rect = _rects(rows, ids, slots * nrows, ncols, name)
    if len(rect) == 0:
        return np.zeros((0, BLOCK_FIELDS), np.int64), np.zeros((0, SUB_FIELDS), np.int64)
    # Rows: blocks of bn rows restart at every slot; columns: blocks of bk.
    row_block = lambda r: (r // nrows) * nbr + (r % nrows) // bn  # noqa: E731
    row_start = lambda g: (g // nbr) * nrows + (g % nbr) * bn  # noqa: E731
    row_end = lambda g: np.minimum(row_start(g) + bn, (g // nbr + 1) * nrows)  # noqa: E731
    own_r, gr, rs, rn = _split(rect[:, 3], rect[:, 5], row_block, row_start, row_end)
    pr = rect[own_r]
    own_c, gc, cs, cn = _split(pr[:, 4], pr[:, 6], lambda c: c // bk, lambda g: g * bk,
                               lambda g: np.minimum(g * bk + bk, ncols))
    p, gr, rs, rn = pr[own_c], gr[own_c], rs[own_c], rn[own_c]
    block = gr * nbc + gc
    sub = np.zeros((len(p), SUB_FIELDS), np.int64)
    sub[:, 0] = p[:, 0]
    sub[:, 1] = np.where(p[:, 0] == FILL, 0, p[:, 1] + (rs - p[:, 3]) * p[:, 2] + (cs - p[:, 4]))
    sub[:, 2] = p[:, 2]
    sub[:, 3] = rs - row_start(gr)
    sub[:, 4] = cs - gc * bk
    sub[:, 5] = rn
    sub[:, 6] = cn
    order = np.argsort(block, kind="stable")
    sub, block = sub[order], block[order]
    bids, first, counts = np.unique(block, return_index=True, return_counts=True)
    g_row, g_col = bids // nbc, bids % nbc
    b_rows = row_end(g_row) - row_start(g_row)
    b_cols = np.minimum(g_col * bk + bk, ncols) - g_col * bk
    area = np.add.reduceat(sub[:, 5] * sub[:, 6], first)
    short = np.flatnonzero(area != b_rows * b_cols)
    if short.size:
        k = int(short[0])
        e, bi = divmod(int(g_row[k]), nbr)
        where = f"slot {e}, " if slots > 1 else ""
        raise PieceTableError(f"{name}: FP8 block ({where}block row {bi}, block col {int(g_col[k])}) is written "
                              f"{int(area[k])} of {int(b_rows[k] * b_cols[k])} elements: a block's scale needs the "
                              "whole block in one call")
    blocks = np.zeros((len(bids), BLOCK_FIELDS), np.int64)
    blocks[:, 0] = row_start(g_row) * ncols + g_col * bk
    blocks[:, 1] = bids
    blocks[:, 2] = ncols
    blocks[:, 3] = b_rows
    blocks[:, 4] = b_cols
    blocks[:, 5] = first
    blocks[:, 6] = first + counts
    # One sub-piece (a rectangle inside the block) with the block's whole area (checked above): it starts at the
    # block's (0, 0) and spans its nrows x ncols.
    blocks[:, WHOLE] = (counts == 1) & (sub[first, 0] != FILL)
    return blocks, sub


# ---------------------------------------------------------------------------------------------------------------
# The torch executor.

def execute_fp8_torch(dst: torch.Tensor, spec: BlockFp8, srcs, table: PieceTable, blocks: np.ndarray) -> None:
    """Gather the pieces into a float32 staging copy (exact: bf16/fp16 widen losslessly), quantize it with
    `quantize_blocks` and write back the touched blocks only."""
    slots, nrows, ncols = spec.geometry
    staging = torch.zeros(slots * nrows * ncols, dtype=torch.float32, device=dst.device)
    copy_pieces_torch(staging, srcs, table)
    if spec.scaling == "channel":
        from .fp8_channel import quantize_channels
        q, scale = quantize_channels(staging.view(nrows, ncols))
        q, scale = q.view(slots, nrows, ncols), scale.view(slots, nrows, 1)  # block (1, cols): one scale a row
    else:
        q, scale = quantize_blocks(staging.view(slots, nrows, ncols), spec.block)
    flat_scale = scale.view(-1)
    idx = torch.from_numpy(blocks[:, 1]).to(dst.device)
    if len(idx) == flat_scale.numel():
        dst.view(torch.uint8).copy_(q.view(-1).view(torch.uint8))
        spec.scale.copy_(flat_scale)
        return
    bn, bk = spec.block
    mask = torch.zeros(flat_scale.numel(), dtype=torch.bool, device=dst.device)
    mask[idx] = True
    nbr, nbc = scale.shape[-2:]
    elem = mask.view(slots, nbr, nbc).repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :nrows, :ncols]
    out = dst.view(torch.uint8).view(slots, nrows, ncols)
    out[elem] = q.view(torch.uint8)[elem]
    spec.scale[idx] = flat_scale[idx]


def check_specs(dsts, quant: Mapping[int, BlockFp8]) -> None:
    for d, spec in quant.items():
        if not isinstance(spec, BlockFp8):
            raise PieceTableError(f"quant[{d}] must be a BlockFp8, got {type(spec).__name__}")
        if not 0 <= d < len(dsts):
            raise PieceTableError(f"quant names dsts[{d}] but there are {len(dsts)} destinations")
        spec.check(f"dsts[{d}]", dsts[d])
