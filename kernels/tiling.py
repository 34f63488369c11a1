"""Host-side tiling: a validated piece table -> one row per Triton program.

Every program copies one [BLOCK_R, BLOCK_C] tile, so the work per program is bounded whatever the
piece sizes: a 1 GB piece becomes many full tiles, a 1x1 piece one tiny tile, and the GPU's block
scheduler balances them. Row-contiguous pieces (nrows == 1, or both row strides equal ncols) are
re-cut into rows of exactly BLOCK_C elements, so their tiles are full whatever their shape; only
truly strided pieces pay for padding, and BLOCK_C is chosen per table to keep that padding small.

Tile rows are int64 [T, 8]: (src_index, src_offset, src_stride, dst_offset, dst_stride, nrows,
ncols, 0) with offsets pointing at the tile's first element. Strides of single-row tiles and
offsets/strides of zero fills are set to 0 so they never spoil the kernel's alignment test.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pieces import DST_OFFSET, DST_STRIDE, FILL, NCOLS, NROWS, SRC_INDEX, SRC_OFFSET, SRC_STRIDE

TILE_FIELDS = 8
# Order of tiles over program ids. "table": piece by piece as the table lists them (row-major within a
# piece). "dst": sorted by destination address, so the programs resident at any moment write one
# contiguous stretch of the destination, the way a plain copy_ does, whatever the table's piece order
# (e.g. the two TP halves of an MoE w2 row, listed far apart, become neighbours).
TILE_ORDERS = ("table", "dst")
MIN_BLOCK_C = 64  # 128+ bytes per tile row for bf16: whole cache lines per row
# Measured on the H200 (docs/archive/results-2026-11.md section 34, the MoE bucket's pieces by class, kernel alone / copy): rows of a
# tile shorter than ~512 elements cost bandwidth, padded lanes cost little. Row-contiguous pieces: 0.82 at 64 x 128
# tiles, 0.97 at 8 x 1024, 0.92 at 1 x 8192; 384-wide strided pieces: 0.81 at width 128 (no padding), 0.84 at 256,
# 0.91 at 512 (a quarter of the lanes padding). Hence the widest tile is capped at 1024 and every row segment a tile
# reads is charged like SEGMENT_COST lanes in choose_block_c's cost (256 picks 512 for those strided pieces and
# 1024 for the dense bucket's, the measured best of the widths tried).
MAX_BLOCK_C = 1024
SEGMENT_COST = 256


@dataclass(frozen=True)
class TilePlan:
    tiles: np.ndarray  # int64 [T, TILE_FIELDS]
    block_r: int
    block_c: int


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _recut_contiguous(p: np.ndarray, width: int) -> np.ndarray:
    """Re-cut row-contiguous pieces into `width`-wide rows: a main block plus a one-row tail."""
    n = p[:, NROWS] * p[:, NCOLS]
    full, tail = n // width, n % width
    main = p[full > 0].copy()
    f = full[full > 0]
    main[:, SRC_STRIDE] = width
    main[:, DST_STRIDE] = width
    main[:, NROWS] = f
    main[:, NCOLS] = width
    rest = p[tail > 0].copy()
    consumed = full[tail > 0] * width
    rest[:, SRC_OFFSET] += consumed
    rest[:, DST_OFFSET] += consumed
    rest[:, SRC_STRIDE] = width
    rest[:, DST_STRIDE] = width
    rest[:, NROWS] = 1
    rest[:, NCOLS] = tail[tail > 0]
    return np.concatenate([main, rest])


def _split(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty pieces; return (row-contiguous pieces, strided pieces)."""
    p = rows[(rows[:, NROWS] > 0) & (rows[:, NCOLS] > 0)]
    nc = p[:, NCOLS]
    fill = p[:, SRC_INDEX] == FILL
    contiguous = (p[:, NROWS] == 1) | (((p[:, SRC_STRIDE] == nc) | fill) & (p[:, DST_STRIDE] == nc))
    return p[contiguous], p[~contiguous]


def _tile_cost(pieces: np.ndarray, block: int, block_c: int) -> float:
    """Lanes issued (active rows x padded width), a fixed per-program overhead of a quarter tile, and
    SEGMENT_COST lanes per row segment read (active rows x column tiles)."""
    block_r = block // block_c
    nr, nc = pieces[:, NROWS], pieces[:, NCOLS]
    col_tiles = -(-nc // block_c)
    tiles = -(-nr // block_r) * col_tiles
    return float((tiles * (block // 4)).sum() + (nr * col_tiles * (block_c + SEGMENT_COST)).sum())


def choose_block_c(rows: np.ndarray, block: int) -> int:
    """Tile width (at most MAX_BLOCK_C) of least cost on the strided pieces. Row-contiguous pieces are left
    out: they are re-cut to whatever width is chosen and fill their tiles (all but one tail) at any width."""
    _, strided = _split(rows)
    top = min(block, MAX_BLOCK_C)
    best, best_cost = top, None
    c = MIN_BLOCK_C
    while c <= top:
        cost = _tile_cost(strided, block, c)
        if best_cost is None or cost <= best_cost:  # ties go to the wider tile: longer contiguous runs
            best, best_cost = c, cost
        c *= 2
    return best


def plan_tiles(rows: np.ndarray, block: int, block_c: int | None = None, order: str = "table") -> TilePlan:
    """Tile a validated piece table. `block` = elements per tile (power of two >= MIN_BLOCK_C);
    `order` one of TILE_ORDERS. The order never changes what is written (pieces do not overlap in
    the destination), only which tiles run side by side."""
    if order not in TILE_ORDERS:
        raise ValueError(f"tile order must be one of {TILE_ORDERS}, got {order!r}")
    if not _is_pow2(block) or block < MIN_BLOCK_C:
        raise ValueError(f"tile block must be a power of two >= {MIN_BLOCK_C}, got {block}")
    if block_c is None:
        block_c = choose_block_c(rows, block)
    if not _is_pow2(block_c) or block_c > block:
        raise ValueError(f"block_c must be a power of two <= block ({block}), got {block_c}")
    block_r = block // block_c
    contiguous, strided = _split(rows)
    p = np.concatenate([_recut_contiguous(contiguous, block_c), strided])
    if len(p) == 0:
        return TilePlan(np.zeros((0, TILE_FIELDS), np.int64), block_r, block_c)
    nr, nc = p[:, NROWS], p[:, NCOLS]
    row_tiles, col_tiles = -(-nr // block_r), -(-nc // block_c)
    count = row_tiles * col_tiles
    owner = np.repeat(np.arange(len(p)), count)
    k = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    ti, tj = k // col_tiles[owner], k % col_tiles[owner]
    q = p[owner]
    t = np.zeros((len(q), TILE_FIELDS), np.int64)
    t[:, 0] = q[:, SRC_INDEX]
    t[:, 1] = q[:, SRC_OFFSET] + ti * block_r * q[:, SRC_STRIDE] + tj * block_c
    t[:, 2] = q[:, SRC_STRIDE]
    t[:, 3] = q[:, DST_OFFSET] + ti * block_r * q[:, DST_STRIDE] + tj * block_c
    t[:, 4] = q[:, DST_STRIDE]
    t[:, 5] = np.minimum(block_r, q[:, NROWS] - ti * block_r)
    t[:, 6] = np.minimum(block_c, q[:, NCOLS] - tj * block_c)
    single = t[:, 5] == 1
    t[single, 2] = 0
    t[single, 4] = 0
    fill = t[:, 0] == FILL
    t[fill, 1] = 0
    t[fill, 2] = 0
    if order == "dst":
        t = t[np.argsort(t[:, 3], kind="stable")]
    return TilePlan(t, block_r, block_c)
