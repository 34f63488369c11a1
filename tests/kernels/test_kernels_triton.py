"""The Triton executor (TRITON_INTERPRET=1 on CPU) equals the torch executor bit for bit."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kernel_tables import coverage, make_sources, random_table
from mtrain.kernels import PieceTable, PieceTableError, execute_pieces_torch, triton_available

pytestmark = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests on CPU tensors (compiled GPU runs: test_kernels_cuda.py, the benchmark)")

if triton_available():
    from mtrain.kernels.triton_pieces import bind_pieces, execute_pieces_triton


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_both(dst_dtype, srcs, table, n, **kwargs):
    want = torch.full((n,), float("nan"), dtype=torch.float32).to(dst_dtype)
    got = want.clone()
    execute_pieces_torch(want, srcs, table)
    execute_pieces_triton(got, srcs, table, **kwargs)
    return got, want


CASES = [
    ("bf16<-bf16", torch.bfloat16, [torch.bfloat16] * 3, 8192),
    ("fp32<-fp32", torch.float32, [torch.float32] * 3, 8192),
    ("bf16<-fp32", torch.bfloat16, [torch.float32] * 2, 8192),
    ("fp32<-bf16", torch.float32, [torch.bfloat16] * 2, 8192),
    ("bf16<-mixed", torch.bfloat16, [torch.float32, torch.bfloat16, torch.float16], 8192),
    ("fp16<-mixed", torch.float16, [torch.float32, torch.bfloat16], 8192),
    # Small tiles: big pieces split over many programs, in both rows and columns.
    ("bf16<-bf16 small tiles", torch.bfloat16, [torch.bfloat16] * 2, 128),
    ("fp32<-bf16 small tiles", torch.float32, [torch.bfloat16, torch.float32], 256),
]


@pytest.mark.parametrize("name,dst_dtype,src_dtypes,block", CASES, ids=[c[0] for c in CASES])
def test_random_tables_bit_exact(name, dst_dtype, src_dtypes, block):
    rng = np.random.default_rng(abs(hash(name)) % (1 << 31))
    srcs = make_sources(rng, src_dtypes, 3000)
    table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=14)
    got, want = run_both(dst_dtype, srcs, table, n, block=block)
    assert torch.equal(bits(got), bits(want)), name
    covered = torch.from_numpy(coverage(table, n))
    assert not got[covered].isnan().any() and got[~covered].isnan().all()


def test_many_sources_one_launch():
    rng = np.random.default_rng(3)
    srcs = make_sources(rng, [torch.bfloat16] * 40, 400)
    table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=60, fill_fraction=0.05)
    assert len(set(table.rows[:, 0].tolist()) - {-1}) > 25
    got, want = run_both(torch.bfloat16, srcs, table, n)
    assert torch.equal(bits(got), bits(want))


def test_raw_copies_keep_every_bit():
    # Same dtype moves bits, not values: NaN payloads, -0.0 and fp8 survive unchanged.
    payload = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x3F800000], dtype=torch.int64)
    src = payload.to(torch.int32).view(torch.float32)
    table = PieceTable.from_rows([(0, 0, 2, 1, 3, 2, 2)])
    got = torch.zeros(6)
    execute_pieces_triton(got, [src], table)
    assert bits(got).tolist() == [0, *bits(src)[:2].tolist(), 0, *bits(src)[2:].tolist()]
    fp8 = torch.randn(64).to(torch.float8_e4m3fn)
    got8 = torch.zeros(64, dtype=torch.float8_e4m3fn)
    execute_pieces_triton(got8, [fp8], PieceTable.from_rows([(0, 0, 0, 0, 0, 1, 64)]))
    assert torch.equal(bits(got8), bits(fp8))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, fp32 -> fp16 inf
def test_casts_round_to_nearest_even_like_torch():
    # Halfway cases and carries into the exponent, where truncation or round-half-up would differ.
    vals = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 - 2 ** -9, 3.3895e38, -2.5e-39, 65519.0,
                         float("inf"), -float("inf")], dtype=torch.float32)
    table = PieceTable.from_rows([(0, 0, 0, 0, 0, 1, len(vals))])
    for dt in (torch.bfloat16, torch.float16):
        got, want = torch.empty(len(vals), dtype=dt), torch.empty(len(vals), dtype=dt)
        execute_pieces_triton(got, [vals], table)
        execute_pieces_torch(want, [vals], table)
        assert torch.equal(bits(got), bits(want)), dt


def test_only_fills_and_empty_table():
    table = PieceTable.from_rows([(-1, 0, 0, 3, 10, 4, 5)])
    got = torch.full((40,), float("nan"), dtype=torch.bfloat16)
    execute_pieces_triton(got, [], table)
    assert (got.view(4, 10)[:, 3:8] == 0).all() and got.isnan().sum() == 20
    before = got.clone()
    execute_pieces_triton(got, [], PieceTable(torch.zeros(0, 7, dtype=torch.int64)))
    assert torch.equal(bits(got), bits(before))


def test_triton_rejects_bad_tables_before_launch():
    dst = torch.full((8,), 5.0)
    table = PieceTable.from_rows([(0, 0, 4, 0, 4, 2, 4), (0, 0, 4, 4, 4, 1, 5)])
    with pytest.raises(PieceTableError, match="piece 1: writes dst elements up to 9 but dst has 8"):
        execute_pieces_triton(dst, [torch.ones(8)], table)
    assert (dst == 5.0).all()
    with pytest.raises(PieceTableError, match=r"srcs\[1\] has dtype torch.float64 and dst torch.float32"):
        execute_pieces_triton(torch.zeros(8), [torch.ones(8), torch.ones(8, dtype=torch.float64)],
                              PieceTable.from_rows([(0, 0, 1, 0, 1, 1, 1)]))


def test_rows_edited_in_place_are_replanned():
    src = torch.arange(64, dtype=torch.float32)
    table = PieceTable.from_rows([(0, 0, 8, 0, 8, 4, 8)])
    got = torch.zeros(64)
    execute_pieces_triton(got, [src], table)
    table.rows[0, 1] = 32  # same shape, different source offset: cached tiles must be rebuilt
    execute_pieces_triton(got, [src], table)
    assert torch.equal(got[:32], src[32:])


def test_qkv_regroup_like_the_planner():
    """Megatron's fused QKV rows [g0: q0 q1 k v | g1: q0 q1 k v] -> SGLang's [q; k; v], plus gate/up
    halves of fc1 appended, compared with plain torch indexing. Aligned widths take the hinted path."""
    groups, q_per_group, head_dim, hidden, ffn = 2, 2, 8, 64, 48
    per_group = (q_per_group + 2) * head_dim
    qkv = torch.randn(groups * per_group, hidden).bfloat16()
    fc1 = torch.randn(2 * ffn, hidden)  # fp32 master weights, cast to bf16 on the way
    q_rows, kv_rows = q_per_group * head_dim, head_dim
    n_q = groups * q_rows
    rows = []
    for g in range(groups):
        base = g * per_group
        rows.append((0, base * hidden, hidden, g * q_rows * hidden, hidden, q_rows, hidden))
        rows.append((0, (base + q_rows) * hidden, hidden, (n_q + g * kv_rows) * hidden, hidden, kv_rows, hidden))
        rows.append((0, (base + q_rows + kv_rows) * hidden, hidden,
                     (n_q + (groups + g) * kv_rows) * hidden, hidden, kv_rows, hidden))
    qkv_numel = qkv.numel()
    rows.append((1, 0, hidden, qkv_numel, hidden, 2 * ffn, hidden))
    table = PieceTable.from_rows(rows)
    q = qkv.view(groups, per_group, hidden)
    want = torch.cat([q[:, :q_rows].reshape(-1), q[:, q_rows:q_rows + kv_rows].reshape(-1),
                      q[:, q_rows + kv_rows:].reshape(-1), fc1.bfloat16().reshape(-1)])
    got = torch.full_like(want, float("nan"))
    execute_pieces_triton(got, [qkv, fc1], table, block=1024)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("block", [128, 8192])
def test_destination_tile_order_bit_exact(block):
    """tile_order="dst" only permutes the programs: same bits as the torch executor."""
    rng = np.random.default_rng(block + 1)
    srcs = make_sources(rng, [torch.bfloat16, torch.float32], 3000)
    table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=30, fill_fraction=0.1)
    got, want = run_both(torch.bfloat16, srcs, table, n, block=block, tile_order="dst")
    assert torch.equal(bits(got), bits(want))
    bound = torch.full((n,), float("nan")).to(torch.bfloat16)  # the same poison bits as run_both's
    bind_pieces(bound, srcs, table, block=block, tile_order="dst")()
    assert torch.equal(bits(bound), bits(want))


def test_repeated_calls_follow_changed_sources():
    """validate_call reuses the previous call's checks only for identical sources: a new tensor in a
    source's place is read, a too-small or non-contiguous one is refused before any write."""
    table = PieceTable.from_rows([(0, 0, 4, 0, 8, 3, 4), (1, 2, 0, 24, 0, 1, 6)])
    a, b = torch.arange(12.0), torch.arange(100.0, 108.0)
    dst = torch.zeros(32)
    execute_pieces_triton(dst, [a, b], table)
    execute_pieces_triton(dst, [a, b], table)
    a2 = torch.arange(50.0, 62.0)
    execute_pieces_triton(dst, [a2, b], table)
    want = torch.zeros(32)
    execute_pieces_torch(want, [a2, b], table)
    assert torch.equal(dst, want)
    with pytest.raises(PieceTableError, match="piece 0: reads src 0 elements up to 12 but it has 11"):
        execute_pieces_triton(dst, [torch.arange(11.0), b], table)
    with pytest.raises(PieceTableError, match=r"srcs\[0\] must be a contiguous tensor"):
        execute_pieces_triton(dst, [torch.arange(24.0).view(2, 12).t(), b], table)
    with pytest.raises(PieceTableError, match=r"srcs\[1\] has dtype torch.float64"):
        execute_pieces_triton(dst, [a2, b.double()], table)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="tile order must be one of"):
        execute_pieces_triton(dst, [a2, b], table, tile_order="random")
