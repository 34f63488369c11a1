"""Host tiling: the tiles write exactly the (dst <- src) element pairs the pieces describe."""
from __future__ import annotations

import numpy as np
import pytest

from kernel_tables import random_table
from mtrain.kernels import PieceTable
from mtrain.kernels.tiling import MAX_BLOCK_C, MIN_BLOCK_C, choose_block_c, plan_tiles


def element_map(rows: np.ndarray, dst_numel: int) -> np.ndarray:
    """dst element -> (src_index, src element), (-2, -2) where nothing is written."""
    out = np.full((dst_numel, 2), -2, np.int64)
    for i, so, ss, do, ds, nr, nc, *_ in rows.tolist():
        for r in range(nr):
            out[do + r * ds: do + r * ds + nc, 0] = i
            out[do + r * ds: do + r * ds + nc, 1] = -1 if i == -1 else np.arange(so + r * ss, so + r * ss + nc)
    return out


@pytest.mark.parametrize("block", [64, 256, 2048])
def test_tiles_cover_exactly_the_pieces(block):
    rng = np.random.default_rng(block)
    table, n = random_table(rng, [5000, 7000, 3000], n_pieces=40)
    plan = plan_tiles(table.rows.numpy(), block)
    assert plan.block_r * plan.block_c == block
    tiles = plan.tiles
    assert (tiles[:, 5] <= plan.block_r).all() and (tiles[:, 6] <= plan.block_c).all()
    assert (tiles[:, 5] > 0).all() and (tiles[:, 6] > 0).all()
    assert np.array_equal(element_map(tiles, n), element_map(table.rows.numpy(), n))


def test_block_c_follows_the_strided_widths():
    contiguous = PieceTable.from_rows([(0, 0, 4096, 0, 4096, 100, 4096), (0, 7, 0, 5, 0, 1, 3)])
    # any width fits; the widest up to MAX_BLOCK_C (8 x 1024 tiles beat 1 x 8192 on the H200)
    assert choose_block_c(contiguous.rows.numpy(), 8192) == MAX_BLOCK_C == 1024
    assert choose_block_c(contiguous.rows.numpy(), 256) == 256  # never wider than the tile
    # 384-wide column slices (an MoE w2 half): 512-wide tiles (a quarter padded) over 128-wide ones (none padded),
    # as measured on the H200; 64-wide slices get 64-wide tiles.
    w2_half = PieceTable.from_rows([(0, 0, 384, 0, 768, 2048, 384)])
    assert choose_block_c(w2_half.rows.numpy(), 8192) == 512
    thin = PieceTable.from_rows([(0, 0, 64, 0, 128, 4096, 64)])
    assert choose_block_c(thin.rows.numpy(), 8192) == 64
    narrow = PieceTable.from_rows([(0, 0, 10, 0, 10, 1000, 5)] * 1)
    assert choose_block_c(narrow.rows.numpy(), 8192) == MIN_BLOCK_C
    # Row-parallel column slices 1536 wide: 512-wide tiles pad nothing, 2048-wide would pad 25 %.
    wide = PieceTable.from_rows([(0, 0, 1536, 0, 6144, 64, 1536)])
    c = choose_block_c(wide.rows.numpy(), 8192)
    assert 1536 % c == 0


def test_bad_block_sizes():
    rows = PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 1)]).rows.numpy()
    with pytest.raises(ValueError, match="power of two"):
        plan_tiles(rows, 1000)
    with pytest.raises(ValueError, match="block_c must be a power of two <= block"):
        plan_tiles(rows, 1024, block_c=2048)


@pytest.mark.parametrize("block", [64, 2048])
def test_destination_order_permutes_the_same_tiles(block):
    rng = np.random.default_rng(block + 7)
    table, n = random_table(rng, [5000, 7000, 3000], n_pieces=40)
    by_table = plan_tiles(table.rows.numpy(), block)
    by_dst = plan_tiles(table.rows.numpy(), block, order="dst")
    assert (by_dst.block_r, by_dst.block_c) == (by_table.block_r, by_table.block_c)
    assert (np.diff(by_dst.tiles[:, 3]) >= 0).all()
    assert sorted(map(tuple, by_dst.tiles.tolist())) == sorted(map(tuple, by_table.tiles.tolist()))
    with pytest.raises(ValueError, match="tile order must be one of"):
        plan_tiles(table.rows.numpy(), block, order="shuffled")
