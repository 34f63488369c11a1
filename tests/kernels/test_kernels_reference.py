"""The torch reference executor against a naive element loop, and validation of bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_tables import coverage, make_sources, random_table
from mtrain.kernels import PieceTable, PieceTableError, execute_pieces, execute_pieces_torch, validate


def naive_execute(dst: torch.Tensor, srcs: list[torch.Tensor], table: PieceTable) -> None:
    """Element by element, with python floats; casts happen on assignment (torch's own rounding)."""
    flat = [s.reshape(-1) for s in srcs]
    for i, so, ss, do, ds, nr, nc in table.rows.tolist():
        for r in range(nr):
            for c in range(nc):
                dst[do + r * ds + c] = 0.0 if i == -1 else flat[i][so + r * ss + c].item()


@pytest.mark.parametrize("dst_dtype,src_dtypes", [
    (torch.float32, [torch.float32, torch.float32]),
    (torch.bfloat16, [torch.float32, torch.bfloat16, torch.float16]),
    (torch.float32, [torch.bfloat16, torch.bfloat16, torch.bfloat16]),
])
def test_torch_executor_matches_naive_loop(dst_dtype, src_dtypes):
    rng = np.random.default_rng(7)
    srcs = make_sources(rng, src_dtypes, 2000)
    table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=12)
    got = torch.full((n,), float("nan"), dtype=dst_dtype)
    want = got.clone()
    execute_pieces_torch(got, srcs, table)
    naive_execute(want, srcs, table)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    covered = torch.from_numpy(coverage(table, n))
    assert covered.any() and (~covered).any()
    assert not got[covered].isnan().any() and got[~covered].isnan().all()


def test_auto_backend_on_cpu_and_fills():
    src = torch.arange(12, dtype=torch.float32)
    dst = torch.full((10,), -1.0)
    table = PieceTable.from_rows([(0, 1, 4, 0, 3, 2, 3), (-1, 0, 0, 6, 0, 1, 2), (0, 0, 0, 9, 1, 0, 4)])
    execute_pieces(dst, [src], table)  # "auto" on CPU tensors runs the torch executor
    assert dst.tolist() == [1, 2, 3, 5, 6, 7, 0, 0, -1, -1]


def test_interleaved_column_blocks_are_not_an_overlap():
    # Two column blocks of a 4x6 matrix written row by row: bounding ranges overlap, elements do not.
    table = PieceTable.from_rows([(0, 0, 2, 0, 6, 4, 2), (0, 0, 4, 2, 6, 4, 4)])
    validate(table, 24, [16])


BAD_TABLES = [
    ([(0, 0, 1, 0, 1, -1, 1)], [10], 10, "piece 0: negative"),
    ([(0, 0, 1, 0, 1, 1, 1), (0, -2, 1, 2, 1, 1, 1)], [10], 10, "piece 1: negative"),
    ([(0, 0, 1, 0, 1, 1, 1), (2, 0, 1, 2, 1, 1, 1)], [10, 10], 10, "piece 1: src_index 2 out of range"),
    ([(-2, 0, 1, 0, 1, 1, 1)], [10], 10, "piece 0: src_index -2"),
    ([(0, 0, 4, 0, 4, 3, 4)], [12], 11, "piece 0: writes dst elements up to 12 but dst has 11"),
    ([(0, 0, 1, 0, 1, 1, 1), (0, 5, 4, 0 + 1, 4, 2, 4)], [12], 12, "piece 1: reads src 0 elements up to 13"),
    ([(0, 0, 4, 0, 3, 2, 4)], [12], 12, "piece 0: dst_row_stride 3 < ncols 4"),
    ([(0, 0, 4, 0, 8, 2, 4), (-1, 0, 0, 7, 0, 1, 2)], [12], 16, "piece 1: overlaps piece 0 in dst at element 8"),
    ([(0, 0, 1, 0, 1, 1, 1 << 50)], [10], 10, "above 2**48"),
]


@pytest.mark.parametrize("rows,src_numels,dst_numel,message", BAD_TABLES)
def test_bad_tables_raise_naming_the_piece(rows, src_numels, dst_numel, message):
    table = PieceTable.from_rows(rows)
    with pytest.raises(PieceTableError, match=message.replace("*", r"\*")):
        validate(table, dst_numel, src_numels)
    # The executor refuses before writing anything.
    dst = torch.full((dst_numel,), 7.0)
    with pytest.raises(PieceTableError, match=message.replace("*", r"\*")):
        execute_pieces(dst, [torch.ones(n) for n in src_numels], table)
    assert (dst == 7.0).all()


def test_piece_table_shape_and_tensor_checks():
    with pytest.raises(PieceTableError, match=r"int64 \[N, 7\]"):
        PieceTable(torch.zeros(3, 6, dtype=torch.int64))
    with pytest.raises(PieceTableError, match=r"int64 \[N, 7\]"):
        PieceTable(torch.zeros(3, 7, dtype=torch.int32))
    table = PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 2)])
    with pytest.raises(PieceTableError, match="dst must be a flat contiguous 1-D tensor"):
        execute_pieces(torch.zeros(2, 2), [torch.ones(4)], table)
    with pytest.raises(PieceTableError, match=r"srcs\[0\] must be a contiguous tensor"):
        execute_pieces(torch.zeros(4), [torch.ones(4, 4).t()], table)
    with pytest.raises(PieceTableError, match=r"srcs\[1\] has dtype torch.int32 and dst torch.bfloat16"):
        execute_pieces(torch.zeros(4, dtype=torch.bfloat16), [torch.ones(4), torch.ones(4, dtype=torch.int32)],
                       table)
    with pytest.raises(ValueError, match="backend must be one of"):
        execute_pieces(torch.zeros(4), [torch.ones(4)], table, backend="cuda")


def test_in_place_edit_of_rows_is_revalidated():
    table = PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 4)])
    dst, src = torch.zeros(4), torch.arange(4.0)
    execute_pieces_torch(dst, [src], table)
    table.rows[0, 6] = 5  # now out of bounds: the cached validation must not hide it
    with pytest.raises(PieceTableError, match="piece 0: writes dst elements up to 5"):
        execute_pieces_torch(dst, [src], table)
