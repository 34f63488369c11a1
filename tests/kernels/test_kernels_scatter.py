"""execute_scatter: one table into many destinations. Triton (interpreter) == torch executor bit for
bit, both == a plain slice loop, untouched elements stay NaN; bad input refused before any write."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from kernel_tables import ScatterCase, make_sources
from mtrain.kernels import PieceTable, PieceTableError, ScatterTable, execute_scatter, triton_available

INTERPRETED = triton_available() and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (compiled runs: cuda_random_tables.py)"))]
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton interpreter tests on CPU tensors")

BF16, FP32, FP16, FP8 = torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def naive_scatter(dsts: list[torch.Tensor], srcs: list[torch.Tensor], st: ScatterTable) -> None:
    """Row by row with plain slices (no as_strided, no tiles); copy_ casts with torch's rounding."""
    flat = [s.reshape(-1) for s in srcs]
    for (i, so, ss, do, ds, nr, nc), d in zip(st.table.rows.tolist(), st.dst_index.tolist()):
        for r in range(nr):
            out = dsts[d][do + r * ds: do + r * ds + nc]
            out.zero_() if i == -1 else out.copy_(flat[i][so + r * ss: so + r * ss + nc])


# (name, source dtypes, destination specs (dtype, "own"|"view", allowed sources))
CASES = [
    ("3 bf16 + 2 fp32, casts both ways", [FP32, BF16, FP32, BF16],
     [(BF16, "view", None), (BF16, "own", None), (BF16, "view", None), (FP32, "own", None), (FP32, "view", None)]),
    # bf16 dsts read only bf16 shards (raw-bit group), fp32 dsts cast from bf16 and fp16.
    ("raw bf16 group beside a casting fp32 group", [BF16, FP16, BF16, FP32],
     [(BF16, "view", [0, 2]), (BF16, "view", [2]), (FP32, "own", [0, 1, 3]), (BF16, "own", [0])]),
    # fp8 can only move as raw bits: works only because its group is handed just the fp8 shards.
    ("fp8 beside bf16", [FP8, FP32, FP8],
     [(FP8, "view", [0, 2]), (BF16, "own", [1]), (FP8, "own", [2]), (BF16, "view", [1])]),
    ("fp16 and bf16 from mixed sources", [FP32, BF16, FP16],
     [(FP16, "own", None), (BF16, "view", None), (FP16, "view", None)]),
]


@pytest.mark.parametrize("name,src_dtypes,dst_specs", CASES, ids=[c[0] for c in CASES])
def test_random_scatter_matches_torch_and_naive_loop(name, src_dtypes, dst_specs):
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # stable across runs, unlike hash()
    srcs = make_sources(rng, src_dtypes, 3000)
    case = ScatterCase(rng, [s.numel() for s in srcs], dst_specs)
    results = {}
    for backend in ["naive", "torch"] + (["triton"] if INTERPRETED else []):
        dsts, allocations = case.make_dsts()
        if backend == "naive":
            naive_scatter(dsts, srcs, case.table)
        else:
            execute_scatter(dsts, srcs, case.table, backend=backend)
        results[backend] = (dsts, allocations)
    dsts, allocations = results["torch"]
    covered = case.coverage(allocations, dsts)
    assert sum(c.sum() for c in covered) > 0 and sum((~c).sum() for c in covered) > 0
    for alloc, cov in zip(allocations, covered):  # written elements are numbers, the rest untouched NaN
        as_f32 = alloc.float()
        assert not as_f32[torch.from_numpy(cov)].isnan().any() and as_f32[torch.from_numpy(~cov)].isnan().all()
    for backend, (_, other) in results.items():
        for a, b in zip(other, allocations):
            assert torch.equal(bits(a), bits(b)), f"{name}: {backend} differs from torch"


@needs_interpreter
def test_one_launch_per_destination_dtype(monkeypatch):
    from mtrain.kernels import triton_pieces
    launches = []
    real = triton_pieces.launch_pieces

    def counting(dst, srcs, meta, table, block, num_warps):
        launches.append((dst.dtype, len(srcs)))
        real(dst, srcs, meta, table, block, num_warps)

    monkeypatch.setattr(triton_pieces, "launch_pieces", counting)
    rng = np.random.default_rng(11)
    srcs = make_sources(rng, [BF16, FP32, BF16], 2000)
    specs = [(BF16, "view", [0, 2])] * 3 + [(FP32, "own", [1])] * 2 + [(BF16, "own", [0])]
    case = ScatterCase(rng, [s.numel() for s in srcs], specs, n_pieces=3)
    dsts, _ = case.make_dsts()
    execute_scatter(dsts, srcs, case.table, backend="triton")
    # Each launch gets only the sources its group reads: bf16 group {0, 2}, fp32 group {1}.
    assert sorted(launches, key=str) == sorted([(BF16, 2), (FP32, 1)], key=str)


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_destination_tensors_are_written_not_the_cached_ones(backend):
    src = torch.arange(40, dtype=torch.float32)
    st = ScatterTable.from_rows([(0, 0, 1, 0, 1, 1, 6, 0), (0, 10, 5, 1, 4, 3, 3, 1), (-1, 0, 0, 0, 0, 1, 2, 2)])
    first = [torch.full((6,), -1.0), torch.full((12,), -1.0, dtype=BF16), torch.full((3,), -1.0)]
    execute_scatter(first, [src], st, backend=backend)
    before = [t.clone() for t in first]
    second = [t.clone().fill_(-2) for t in first]  # same sizes, new pointers
    execute_scatter(second, [src], st, backend=backend)
    for old, kept in zip(first, before):
        assert torch.equal(old, kept)
    assert second[0].tolist() == list(range(6))
    assert second[1].float().tolist() == [-2, 10, 11, 12, -2, 15, 16, 17, -2, 20, 21, 22]
    assert second[2].tolist() == [0, 0, -2]
    st.table.rows[0, 1] = 20  # in-place edit of the rows: everything cached must be rebuilt
    execute_scatter(second, [src], st, backend=backend)
    assert second[0].tolist() == list(range(20, 26))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwritten_and_empty(backend):
    # A tied weight passed twice but written once is not an overlap; empty tables write nothing.
    buf = torch.full((8,), 5.0)
    st = ScatterTable.from_rows([(0, 0, 1, 0, 1, 1, 4, 1), (0, 0, 1, 0, 1, 0, 4, 0)])
    execute_scatter([buf, buf], [torch.arange(4.0)], st, backend=backend)
    assert buf.tolist() == [0, 1, 2, 3, 5, 5, 5, 5]
    execute_scatter([buf], [], ScatterTable.from_rows([]), backend=backend)
    execute_scatter([], [], ScatterTable.from_rows([]), backend=backend)
    assert buf.tolist() == [0, 1, 2, 3, 5, 5, 5, 5]


def _bad_calls():
    """(id, dsts, srcs, rows (8 ints) or a ScatterTable, expected message)."""
    big = torch.full((30,), 7.0)
    s = [torch.arange(16.0)]
    return [
        ("dst_index out of range", [torch.full((8,), 7.0), torch.full((4,), 7.0)], s,
         [(0, 0, 1, 0, 1, 1, 2, 0), (0, 0, 1, 0, 1, 1, 2, 2)],
         r"piece 1: dst_index 2 out of range for 2 destinations \(0\.\.1\)"),
        ("negative dst_index", [torch.full((8,), 7.0)], s, [(0, 0, 1, 0, 1, 1, 2, -1)], r"piece 0: dst_index -1"),
        ("piece out of its own dst", [torch.full((8,), 7.0), torch.full((4,), 7.0), torch.full((8,), 7.0)], s,
         [(0, 0, 1, 0, 1, 1, 8, 0), (-1, 0, 0, 0, 0, 1, 2, 2), (0, 0, 1, 1, 1, 1, 4, 1)],
         r"dsts\[1\]: piece 2: writes dst elements up to 5 but dst has 4"),
        ("overlap inside one dst", [torch.full((8,), 7.0), torch.full((8,), 7.0)], s,
         [(0, 0, 1, 0, 1, 1, 4, 1), (0, 0, 1, 0, 1, 1, 8, 0), (0, 0, 1, 3, 1, 1, 2, 1)],
         r"dsts\[1\]: piece 2: overlaps piece 0 in dst at element 3"),
        ("overlapping dsts", [big[0:10], big[12:20], big[8:16]], s,
         [(0, 0, 1, 0, 1, 1, 1, 0), (0, 0, 1, 0, 1, 1, 1, 1), (0, 0, 1, 0, 1, 1, 1, 2)],
         r"dsts\[0\] \[0x[0-9a-f]+, \+40 bytes\) and dsts\[2\] .* overlap in memory"),
        ("same dst twice", [big, big], s, [(0, 0, 1, 0, 1, 1, 1, 0), (0, 0, 1, 5, 1, 1, 1, 1)],
         r"dsts\[0\] .* and dsts\[1\] .* overlap in memory"),
        ("non-contiguous dst", [torch.full((8,), 7.0), big[::2]], s, [(0, 0, 1, 0, 1, 1, 1, 1)],
         r"dsts\[1\] must be a flat contiguous 1-D tensor, got shape torch.Size\(\[15\]\) \(not contiguous\)"),
        ("2-D dst", [torch.full((2, 4), 7.0)], s, [(0, 0, 1, 0, 1, 1, 1, 0)],
         r"dsts\[0\] must be a flat contiguous 1-D tensor, got shape torch.Size\(\[2, 4\]\)"),
        ("dst on another device", [torch.full((8,), 7.0), torch.empty(8, device="meta")], s,
         [(0, 0, 1, 0, 1, 1, 1, 0)], r"dsts\[1\] is on meta but dsts\[0\] is on cpu"),
        ("src on another device", [torch.full((8,), 7.0)], s + [torch.empty(4, device="meta")],
         [(0, 0, 1, 0, 1, 1, 1, 0)], r"srcs\[1\] is on meta but dsts\[0\] is on cpu"),
        ("uncastable source", [torch.full((8,), 7.0), torch.full((8,), 7.0, dtype=BF16)],
         s + [torch.ones(4, dtype=torch.int32)], [(0, 0, 1, 0, 1, 1, 1, 0), (1, 0, 1, 0, 1, 1, 1, 1)],
         r"srcs\[1\] has dtype torch.int32 and dsts\[1\] torch.bfloat16"),
        ("source read out of bounds", [torch.full((8,), 7.0)], s, [(0, 10, 1, 0, 1, 1, 8, 0)],
         r"dsts\[0\]: piece 0: reads src 0 elements up to 18 but it has 16"),
        ("not a ScatterTable", [torch.full((8,), 7.0)], s, PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 1)]),
         "table must be a ScatterTable, got PieceTable"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_writing(case, backend):
    _, dsts, srcs, rows, message = case
    table = rows if isinstance(rows, PieceTable) else ScatterTable.from_rows(rows)
    before = [d.clone() for d in dsts if d.device.type == "cpu"]
    with pytest.raises(PieceTableError, match=message):
        execute_scatter(dsts, srcs, table, backend=backend)
    for d, b in zip([d for d in dsts if d.device.type == "cpu"], before):
        assert torch.equal(d, b)  # nothing written, not even the valid destinations' pieces


def test_scatter_table_construction_errors():
    rows = PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 1), (0, 0, 1, 1, 1, 1, 1)])
    with pytest.raises(PieceTableError, match="dst_index has 1 entries but the table has 2 pieces"):
        ScatterTable(rows, np.array([0]))
    with pytest.raises(PieceTableError, match=r"dst_index must be a 1-D integer array, got int64 \[2, 1\]"):
        ScatterTable(rows, np.zeros((2, 1), np.int64))
    with pytest.raises(PieceTableError, match="dst_index must be a 1-D integer array, got float64"):
        ScatterTable(rows, np.zeros(2))
    with pytest.raises(PieceTableError, match="must be a PieceTable"):
        ScatterTable(rows.rows, np.zeros(2, np.int64))
    with pytest.raises(PieceTableError, match="from_rows needs rows of 8 integers"):
        ScatterTable.from_rows([(0, 0, 1, 0, 1, 1, 1)])
    same = ScatterTable.from_rows(np.array([[0, 0, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1]]))
    assert torch.equal(same.table.rows, rows.rows) and same.dst_index.tolist() == [0, 1]
    st = ScatterTable(rows, torch.tensor([0, 1]))  # a torch index is accepted and copied read-only
    assert st.dst_index.dtype == np.int64 and not st.dst_index.flags.writeable
    with pytest.raises(ValueError, match="backend must be one of"):
        execute_scatter([torch.zeros(2)], [torch.ones(2)], st, backend="cuda")


@needs_interpreter
def test_triton_refuses_a_dtype_without_raw_copy_before_any_launch():
    # complex128 (16 bytes) neither casts nor has a same-size integer: the torch backend copies it,
    # Triton refuses the whole call, even though the bf16 group alone could have run.
    dsts = [torch.full((4,), 7.0, dtype=BF16), torch.zeros(4, dtype=torch.complex128)]
    srcs = [torch.ones(4, dtype=BF16), torch.full((4,), 2 + 1j, dtype=torch.complex128)]
    st = ScatterTable.from_rows([(0, 0, 0, 0, 0, 1, 4, 0), (1, 0, 0, 0, 0, 1, 4, 1)])
    with pytest.raises(PieceTableError, match=r"dsts\[1\] dtype torch.complex128 has no same-size integer type"):
        execute_scatter(dsts, srcs, st, backend="triton")
    assert (dsts[0] == 7).all()
    execute_scatter(dsts, srcs, st, backend="torch")
    assert (dsts[0] == 1).all() and (dsts[1] == 2 + 1j).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_call_reuses_checks_only_for_the_same_tensors(backend):
    """_prepare hands back the previous call's checked result only when every tensor matches it; a
    changed source or destination is checked again and refused before any write."""
    st = ScatterTable.from_rows([(0, 0, 0, 0, 0, 1, 8, 0), (1, 0, 4, 0, 8, 2, 4, 1)])
    srcs = [torch.arange(8.0), torch.arange(10.0, 18.0)]
    dsts = [torch.zeros(8), torch.zeros(16)]
    execute_scatter(dsts, srcs, st, backend=backend)
    execute_scatter(dsts, srcs, st, backend=backend)
    new_src = torch.arange(30.0, 38.0)
    execute_scatter(dsts, [srcs[0], new_src], st, backend=backend)
    assert torch.equal(dsts[1][[0, 1, 2, 3, 8, 9, 10, 11]], new_src)
    before = [d.clone() for d in dsts]
    with pytest.raises(PieceTableError, match="reads src 1 elements up to 8 but it has 7"):
        execute_scatter(dsts, [srcs[0], torch.arange(7.0)], st, backend=backend)
    with pytest.raises(PieceTableError, match="overlap in memory"):
        execute_scatter([dsts[1][:8], dsts[1]], srcs, st, backend=backend)
    with pytest.raises(PieceTableError, match=r"dsts\[1\] must be a flat contiguous 1-D tensor"):
        execute_scatter([dsts[0], dsts[1].view(2, 8)], srcs, st, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(dsts, before))
