"""Compiled Triton (CUDA) == torch executor on the same random tables the interpreter tests use,
for execute_pieces and for execute_scatter (many destinations: views at odd offsets of one buffer,
separate allocations including large ones in their own cudaMalloc segments, mixed dtypes, fp8).

Run by test_kernels_cuda.py in a subprocess with TRITON_INTERPRET=0 (the test suite's conftest
turns the interpreter on for everything else). Exits non-zero and names the case on a mismatch."""
from __future__ import annotations

import sys

import numpy as np
import torch

from kernel_tables import ScatterCase, coverage, make_sources, random_table
from mtrain.kernels import (ScatterTable, execute_pieces, execute_pieces_torch, execute_scatter,
                            execute_scatter_torch, execute_scatter_triton)
from mtrain.kernels.triton_pieces import bind_pieces, execute_pieces_triton, is_interpreted

BF16, FP32, FP16, FP8 = torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn
SCATTER_CASES = [
    ([FP32, BF16, FP32, BF16],
     [(BF16, "view", None), (BF16, "own", None), (BF16, "view", None), (FP32, "own", None), (FP32, "view", None)]),
    ([BF16, FP16, BF16, FP32], [(BF16, "view", [0, 2]), (BF16, "view", [2]), (FP32, "own", [0, 1, 3]),
                                (BF16, "own", [0])]),
    ([FP8, FP32, FP8], [(FP8, "view", [0, 2]), (BF16, "own", [1]), (FP8, "own", [2]), (BF16, "view", [1])]),
    ([FP32, BF16, FP16], [(FP16, "own", None), (BF16, "view", None), (FP16, "view", None)]),
]

CASES = [(torch.bfloat16, [torch.bfloat16] * 3), (torch.float32, [torch.float32] * 2),
         (torch.bfloat16, [torch.float32] * 2), (torch.float32, [torch.bfloat16] * 2),
         (torch.bfloat16, [torch.float32, torch.bfloat16, torch.float16]),
         (torch.float16, [torch.float32, torch.bfloat16])]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def main() -> int:
    assert not is_interpreted() and torch.cuda.is_available()
    failures = []
    for seed in range(4):
        for dst_dt, src_dts in CASES:
            for block in (256, 8192):
                rng = np.random.default_rng(seed)
                srcs = make_sources(rng, src_dts, 3000, device="cuda")
                table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=40)
                want = torch.full((n,), float("nan"), device="cuda").to(dst_dt)
                got, auto = want.clone(), want.clone()
                execute_pieces_torch(want, srcs, table)
                execute_pieces_triton(got, srcs, table, block=block)
                execute_pieces(auto, srcs, table)
                covered = torch.from_numpy(coverage(table, n)).cuda()
                ok = (torch.equal(bits(got), bits(want)) and torch.equal(bits(auto), bits(want))
                      and not got[covered].isnan().any() and bool(got[~covered].isnan().all()))
                if not ok:
                    failures.append(f"seed={seed} dst={dst_dt} srcs={src_dts} block={block}")
    failures += scatter_failures()
    failures += repeated_call_failures()
    print("\n".join(failures) or "all cases equal")
    return 1 if failures else 0


def scatter_failures() -> list[str]:
    failures = []
    for seed in range(4):
        for k, (src_dts, specs) in enumerate(SCATTER_CASES):
            for block in (256, 8192):
                rng = np.random.default_rng(seed)
                srcs = make_sources(rng, src_dts, 3000, device="cuda")
                case = ScatterCase(rng, [s.numel() for s in srcs], specs, n_pieces=12, device="cuda")
                runs = []
                for run in ("torch", "triton", "auto"):
                    dsts, allocs = case.make_dsts()
                    if run == "torch":
                        execute_scatter_torch(dsts, srcs, case.table)
                    elif run == "triton":
                        execute_scatter_triton(dsts, srcs, case.table, block=block)
                        execute_scatter_triton(dsts, srcs, case.table, block=block)  # cached plans
                    else:
                        execute_scatter(dsts, srcs, case.table)
                    runs.append((dsts, allocs))
                covered = case.coverage(runs[0][1], runs[0][0])
                ok = all(torch.equal(bits(a), bits(b)) for r in runs[1:] for a, b in zip(r[1], runs[0][1]))
                for alloc, cov in zip(runs[0][1], covered):
                    mask = torch.from_numpy(cov).cuda()
                    ok = ok and not alloc.float()[mask].isnan().any() and bool(alloc.float()[~mask].isnan().all())
                if not ok:
                    failures.append(f"scatter seed={seed} case={k} block={block}")
    # Large destinations, each its own cudaMalloc segment (far apart in the address space), plus
    # small ones from the caching allocator's pools, written in one launch per dtype.
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = [torch.randn(5_000_000, device="cuda", generator=gen), torch.randn(3_000_000, device="cuda",
                                                                             generator=gen).bfloat16()]
    sizes = [(3_000_001, BF16), (777, BF16), (2_500_000, FP32), (4_096_000, BF16), (33, FP32)]
    rows = []
    for d, (n, _) in enumerate(sizes):
        half = n // 2
        rows.append((d % 2, 3 + d, 0, 0, 0, 1, half, d))  # contiguous run
        rows.append((-1, 0, 0, half, 0, 1, min(5, n - half), d))  # fill
        width = 96 if n > 1000 else 4
        nr = (n - half - 5) // width // 2
        if nr > 0:
            rows.append(((d + 1) % 2, 17, width + 5, half + 5, 2 * width, nr, width, d))  # strided
    st = ScatterTable.from_rows(rows)
    outs = []
    for run in ("torch", "triton"):
        dsts = [torch.full((n,), float("nan"), device="cuda", dtype=dt) for n, dt in sizes]
        (execute_scatter_torch if run == "torch" else execute_scatter_triton)(dsts, src, st)
        outs.append(dsts)
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(*outs)):
        failures.append("scatter large separate allocations")
    return failures


def repeated_call_failures() -> list[str]:
    """One table called again and again, as a sync does: the per-call host caches (validate_call's
    last call, the device source table) must follow new sources, another stream, both tile orders."""
    failures = []
    rng = np.random.default_rng(7)
    table = None
    side = torch.cuda.Stream()
    for step, (order, stream) in enumerate([("table", None), ("table", None), ("dst", None), ("table", side),
                                            ("dst", side), ("table", None)]):
        srcs = make_sources(rng, [BF16, FP32, BF16], 3000, device="cuda")  # new allocations every step
        if table is None:
            table, n = random_table(rng, [s.numel() for s in srcs], n_pieces=40)
        want = torch.full((n,), float("nan"), device="cuda").to(BF16)
        got, bound = want.clone(), want.clone()
        execute_pieces_torch(want, srcs, table)
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            execute_pieces_triton(got, srcs, table, tile_order=order)
            execute_pieces_triton(got, srcs, table, tile_order=order)  # same sources: the cached path
            bind_pieces(bound, srcs, table, tile_order=order)()
        torch.cuda.synchronize()
        if not (torch.equal(bits(got), bits(want)) and torch.equal(bits(bound), bits(want))):
            failures.append(f"repeated calls step={step} order={order} side_stream={stream is not None}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
