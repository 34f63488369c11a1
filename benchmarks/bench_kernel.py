"""Resharding copy kernel vs a plain device copy, on realistic weight-sync buckets.

    python benchmarks/bench_kernel.py --gb 2          # H200: prints a table, writes $OUT/bench_kernel.json
    python benchmarks/bench_kernel.py --dry-run       # CPU, TRITON_INTERPRET=1, tiny sizes: checks it all runs

Scenarios (each a bucket of destination parameters in SGLang's layout, filled from Megatron shards of
train TP=2 into engine TP=1, every shard its own allocation):
  dense  Llama-8B-shaped layers: QKV regrouped per query group, fc1 [gate_r; up_r] -> [gate; up],
         o_proj/down_proj as column slices (strided pieces), norms.
  moe    Qwen3-30B-A3B-shaped layers: per-expert w13 halves and w2 column slices, router, norms.
  cast   the dense bucket from fp32 master shards into bf16.
  tiny   thousands of 1-row pieces (biases, norms, small experts): launch overhead, not bandwidth.
For each: the bandwidth of one plain torch copy_ of the same element count and dtypes (read+write
bytes / time) in the same run is the baseline; the Triton kernel and the torch executor are reported
against it. Correctness (Triton == torch executor, bit for bit, on a NaN-poisoned bucket) is checked
before any timing. The goal is kernel/copy >= 85 % on the bandwidth scenarios.

kernel_ms is the whole call (host work + kernel) under do_bench, as a sync pays it. For dense and moe
each run also records (benchmarks/kernel_diag.py) the host time of one call, the kernel alone in both
tile orders, the call as it was before the per-call host caches, the tile table's fingerprint and the
sources' address alignment: the MoE bucket's run-to-run spread (docs/archive/results-2026-11.md, "MoE bucket spread").
`--diag-only` skips the torch executor (host bound, ~20-30 ms a call) to keep 5-process runs short.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from mtrain.kernels import PieceTable, execute_pieces_torch  # noqa: E402
from mtrain.kernels.pieces import NCOLS, NROWS  # noqa: E402
from mtrain.kernels.tiling import TILE_ORDERS, _split, plan_tiles  # noqa: E402
from mtrain.kernels.triton_pieces import (DEFAULT_BLOCK, DEFAULT_WARPS, TILE_ORDER, bind_pieces,  # noqa: E402
                                          execute_pieces_triton)

import kernel_diag  # noqa: E402  (benchmarks/, next to this file)
from mtrain.kernels import triton_pieces  # noqa: E402


class Bucket:
    """Collects sources (shapes only, allocated later) and pieces into one flat destination."""

    def __init__(self) -> None:
        self.src_numels: list[int] = []
        self.src_dtypes: list[torch.dtype] = []
        self.rows: list[tuple[int, ...]] = []
        self.numel = 0

    def source(self, numel: int, dtype: torch.dtype) -> int:
        self.src_numels.append(numel)
        self.src_dtypes.append(dtype)
        return len(self.src_numels) - 1

    def param(self, numel: int) -> int:
        """Reserve a destination parameter; returns its offset in the bucket."""
        off, self.numel = self.numel, self.numel + numel
        return off

    def piece(self, src: int, s_off: int, s_stride: int, d_off: int, d_stride: int, nr: int, nc: int) -> None:
        self.rows.append((src, s_off, s_stride, d_off, d_stride, nr, nc))

    def copy_flat(self, src: int, s_off: int, d_off: int, n: int) -> None:
        self.piece(src, s_off, n, d_off, n, 1, n)


def dense_layer(b: Bucket, dt: torch.dtype, h: int, heads: int, kv: int, hd: int, ffn: int, tp: int = 2) -> None:
    qpg, gpr = heads // kv, kv // tp  # query heads per group, groups per train rank
    qkv = b.param((heads + 2 * kv) * hd * h)
    q_rows, k_base, v_base = qpg * hd, heads * hd, (heads + kv) * hd
    for r in range(tp):
        s = b.source(gpr * (qpg + 2) * hd * h, dt)
        for g in range(gpr):
            gg, base = r * gpr + g, g * (qpg + 2) * hd
            b.copy_flat(s, base * h, qkv + gg * q_rows * h, q_rows * h)
            b.copy_flat(s, (base + q_rows) * h, qkv + (k_base + gg * hd) * h, hd * h)
            b.copy_flat(s, (base + q_rows + hd) * h, qkv + (v_base + gg * hd) * h, hd * h)
    o = b.param(h * h)
    for r in range(tp):  # row-parallel: each rank holds a column block
        s = b.source(h * h // tp, dt)
        b.piece(s, 0, h // tp, o + r * h // tp, h, h, h // tp)
    gate_up = b.param(2 * ffn * h)
    fr = ffn // tp
    for r in range(tp):
        s = b.source(2 * fr * h, dt)
        b.copy_flat(s, 0, gate_up + r * fr * h, fr * h)
        b.copy_flat(s, fr * h, gate_up + (ffn + r * fr) * h, fr * h)
    down = b.param(h * ffn)
    for r in range(tp):
        s = b.source(h * fr, dt)
        b.piece(s, 0, fr, down + r * fr, ffn, h, fr)
    for _ in range(2):  # input and post-attention norms, replicated: rank 0's copy
        b.copy_flat(b.source(h, dt), 0, b.param(h), h)


def moe_layer(b: Bucket, dt: torch.dtype, h: int, experts: int, inter: int, tp: int = 2) -> None:
    ir = inter // tp
    w13, w2 = b.param(experts * 2 * inter * h), b.param(experts * h * inter)
    for e in range(experts):
        for r in range(tp):
            s = b.source(2 * ir * h, dt)  # Megatron expert fc1 shard [gate_r; up_r]
            b.copy_flat(s, 0, w13 + (e * 2 * inter + r * ir) * h, ir * h)
            b.copy_flat(s, ir * h, w13 + (e * 2 * inter + inter + r * ir) * h, ir * h)
            s = b.source(h * ir, dt)  # expert fc2 shard: a column block of w2[e]
            b.piece(s, 0, ir, w2 + e * h * inter + r * ir, inter, h, ir)
    b.copy_flat(b.source(experts * h, dt), 0, b.param(experts * h), experts * h)  # router
    for _ in range(2):
        b.copy_flat(b.source(h, dt), 0, b.param(h), h)


def tiny_bucket(b: Bucket, dt: torch.dtype, pieces: int, gen: torch.Generator) -> None:
    sizes = torch.randint(16, 2048, (pieces,), generator=gen).tolist()
    per_src = 64
    for start in range(0, pieces, per_src):
        chunk = sizes[start:start + per_src]
        s, off = b.source(sum(chunk), dt), 0
        for n in chunk:
            b.copy_flat(s, off, b.param(n), n)
            off += n


def build(scenario: str, target_bytes: float, tiny: bool) -> tuple[Bucket, torch.dtype]:
    b, dst_dt = Bucket(), torch.bfloat16
    if tiny:  # interpreter-sized shapes, same structure
        dense, moe, n_tiny = dict(h=64, heads=8, kv=4, hd=8, ffn=96), dict(h=64, experts=8, inter=32), 200
    else:
        dense, moe, n_tiny = dict(h=4096, heads=32, kv=8, hd=128, ffn=14336), dict(h=2048, experts=128, inter=768), 20000
    src_dt = torch.float32 if scenario == "cast" else torch.bfloat16
    if scenario == "tiny":
        tiny_bucket(b, src_dt, n_tiny, torch.Generator().manual_seed(0))
        return b, dst_dt
    while b.numel * 2 < target_bytes:
        if scenario == "moe":
            moe_layer(b, src_dt, **moe)
        else:
            dense_layer(b, src_dt, **dense)
        if tiny:
            break
    return b, dst_dt


def elements_moved(table: PieceTable) -> int:
    r = table.rows
    return int((r[:, 5] * r[:, 6]).sum())


def bench(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=max(50, reps * 20), return_mode="median") / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_scenario(name: str, args, device: torch.device) -> dict:
    bucket, dst_dt = build(name, args.gb * 1e9, tiny=args.dry_run)
    table = PieceTable(torch.tensor(bucket.rows, dtype=torch.int64))
    gen = torch.Generator(device=device).manual_seed(0)
    srcs = [torch.randn(n, device=device, dtype=torch.float32, generator=gen).to(dt)
            for n, dt in zip(bucket.src_numels, bucket.src_dtypes)]
    n = elements_moved(table)
    src_es, dst_es = srcs[0].element_size(), torch.empty(0, dtype=dst_dt).element_size()
    moved_bytes = n * (src_es + dst_es)
    dst = torch.full((bucket.numel,), float("nan"), device=device, dtype=dst_dt)
    ref = dst.clone()
    # Correctness first: both executors on a poisoned bucket; every element written, identical bits.
    execute_pieces_torch(ref, srcs, table)
    execute_pieces_triton(dst, srcs, table)
    exact = bool(torch.equal(as_bits(dst), as_bits(ref)))
    complete = not bool(ref.isnan().any())
    if not (exact and complete):
        raise SystemExit(f"{name}: Triton result differs from the torch executor (exact={exact}, "
                         f"complete={complete}); not timing a wrong kernel")
    del ref
    # Baseline: one plain copy_ of the same number of elements and the same dtypes.
    t_copy = copy_seconds(n, srcs[0].dtype, dst_dt, device, args.reps)
    result = dict(scenario=name, pieces=len(table), sources=len(srcs), bucket_bytes=bucket.numel * dst_es,
                  moved_bytes=moved_bytes, copy_ms=t_copy * 1e3, copy_gbps=moved_bytes / t_copy / 1e9,
                  block=DEFAULT_BLOCK, num_warps=DEFAULT_WARPS)
    call = lambda: execute_pieces_triton(dst, srcs, table)  # noqa: E731
    t_kernel = bench(call, device, args.reps)
    result.update(kernel_ms=t_kernel * 1e3, kernel_gbps=moved_bytes / t_kernel / 1e9, kernel_vs_copy=t_copy / t_kernel)
    if name in ("dense", "moe"):
        result["diag"] = diagnose(table, dst, srcs, device, args, t_copy, call)
    sweep = {}
    if args.sweep and name in ("dense", "moe"):
        for block in (4096, 8192, 16384, 32768):
            for warps in (4, 8, 16):
                t = bench(lambda: execute_pieces_triton(dst, srcs, table, block=block, num_warps=warps),
                          device, args.reps)
                sweep[f"block={block},warps={warps}"] = t_copy / t
        result["sweep_kernel_vs_copy"] = sweep
    if args.diag_only:
        return result
    torch_reps = max(1, args.reps // 5) if name == "tiny" else args.reps
    t_torch = bench(lambda: execute_pieces_torch(dst, srcs, table), device, torch_reps)
    result.update(torch_ms=t_torch * 1e3, torch_gbps=moved_bytes / t_torch / 1e9, torch_vs_copy=t_copy / t_torch,
                  kernel_speedup_vs_torch=t_torch / t_kernel)
    return result


def diagnose(table: PieceTable, dst: torch.Tensor, srcs: list[torch.Tensor], device: torch.device, args,
             t_copy: float, call) -> dict:
    """What differs between processes (kernel_diag.py's docstring): ratios are copy time / time."""
    rows = table.numpy()
    d = dict(tile_order_default=TILE_ORDER, host=kernel_diag.host_summary(),
             tiles={o: kernel_diag.tile_summary(plan_tiles(rows, DEFAULT_BLOCK, None, order=o)) for o in TILE_ORDERS},
             src_addresses=kernel_diag.address_summary([s.data_ptr() for s in srcs]),
             dst_address=kernel_diag.address_summary([dst.data_ptr()]))
    old_call = kernel_diag.uncached(table, call)
    d["host_ms_call"] = kernel_diag.host_ms(call, device)
    d["host_ms_call_uncached"] = kernel_diag.host_ms(old_call, device)
    d["call_vs_copy_uncached"] = t_copy / bench(old_call, device, args.reps)
    d["call_vs_copy_back_to_back"] = t_copy * 1e3 / kernel_diag.back_to_back_ms(call, device)
    d["call_vs_copy_back_to_back_uncached"] = t_copy * 1e3 / kernel_diag.back_to_back_ms(old_call, device)
    for order in TILE_ORDERS:  # the kernel alone: host work done once (bind_pieces)
        launch = bind_pieces(dst, srcs, table, tile_order=order)
        d[f"kernel_only_vs_copy_{order}"] = t_copy / bench(launch, device, args.reps)
        d[f"call_vs_copy_{order}"] = t_copy / bench(
            lambda: execute_pieces_triton(dst, srcs, table, tile_order=order), device, args.reps)
    # Whole 384-wide w2 rows per tile (the best width measured in the fresh-allocation state on 2026-11-29, 74 %): 16384-element
    # tiles 512 wide, in both orders. A fresh PieceTable: the tile cache is keyed on block and order, not on width.
    with forced_block_c(512):
        for order in TILE_ORDERS:
            wide = bind_pieces(dst, srcs, PieceTable(table.rows.clone()), block=16384, tile_order=order)
            d[f"kernel_only_vs_copy_{order}_16384x512"] = t_copy / bench(wide, device, args.reps)
    d["piece_classes"] = piece_classes(table, dst, srcs, device, args)
    # The same sources carved from ONE allocation (256-element aligned, like the caching allocator's
    # 512-byte blocks): same count, so the same host work; only where the bytes live differs.
    sizes = [-(-s.numel() // 256) * 256 for s in srcs]
    flat = torch.empty(sum(sizes), device=device, dtype=srcs[0].dtype)
    carved, off = [], 0
    for s_, n in zip(srcs, sizes):
        carved.append(flat[off:off + s_.numel()].copy_(s_))
        off += n
    if device.type == "cuda":
        d["allocator"] = {k: torch.cuda.memory_stats(device).get(k) for k in
                          ("segment.all.current", "segment.large_pool.current", "reserved_bytes.all.current")}
    d["carved_sources_span_gb"] = kernel_diag.address_summary([c.data_ptr() for c in carved])["span_gb"]
    d["kernel_only_vs_copy_carved"] = t_copy / bench(bind_pieces(dst, carved, table), device, args.reps)
    d["call_vs_copy_carved"] = t_copy / bench(lambda: execute_pieces_triton(dst, carved, table), device, args.reps)
    del carved, flat
    return d


def piece_classes(table: PieceTable, dst: torch.Tensor, srcs: list[torch.Tensor], device: torch.device, args) -> dict:
    """Which pieces hold the MoE bucket under 85 %: the row-contiguous ones (re-cut to rows of any width, so their
    tiles are whole runs of memory) and the strided ones (TP column slices: w2's 384 of 768, o_proj/down_proj),
    each alone, the kernel alone against a plain copy of the same element count, at several tile widths
    (8192-element tiles)."""
    out = {}
    contiguous, strided = _split(table.numpy())
    for name, part in (("contiguous", contiguous), ("strided", strided)):
        if not len(part):
            continue
        n = int((part[:, NROWS] * part[:, NCOLS]).sum())
        t_copy = copy_seconds(n, srcs[0].dtype, dst.dtype, device, args.reps)
        rec = dict(pieces=len(part), elements=n, copy_ms=t_copy * 1e3)
        # 128: the width the whole MoE bucket gets (its strided pieces decide it); contiguous pieces tile to any
        # width (1024: dense's 8 x 1024 tiles; 8192: one row per tile); strided ones also at 256 and 512 (padded)
        for width in (128, 256, 512) if name == "strided" else (128, 1024, 8192):
            with forced_block_c(min(width, DEFAULT_BLOCK)):
                launch = bind_pieces(dst, srcs, PieceTable(torch.from_numpy(part.copy())))  # fresh tile cache
                rec[f"kernel_only_vs_copy_width{width}"] = t_copy / bench(launch, device, args.reps)
        out[name] = rec
    return out


def copy_seconds(n: int, src_dtype: torch.dtype, dst_dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """The bandwidth baseline: one plain copy_ of n elements between fresh buffers of these dtypes."""
    flat_src = torch.randn(n, device=device).to(src_dtype)
    copy_dst = torch.empty(n, device=device, dtype=dst_dtype)
    return bench(lambda: copy_dst.copy_(flat_src), device, reps)


@contextlib.contextmanager
def forced_block_c(width: int):
    """triton_pieces.FORCED_BLOCK_C = width inside the block (tables tiled in it keep that width), restored after."""
    forced = triton_pieces.FORCED_BLOCK_C
    triton_pieces.FORCED_BLOCK_C = width
    try:
        yield
    finally:
        triton_pieces.FORCED_BLOCK_C = forced


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="destination bucket size per scenario, GB")
    p.add_argument("--scenarios", default="dense,moe,cast,tiny")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the block/warps sweep")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--diag-only", action="store_true", help="skip the torch executor's timing (diagnostics runs)")
    args = p.parse_args()
    if args.dry_run:
        device, args.reps, args.sweep = torch.device("cpu"), 2, False
    elif not torch.cuda.is_available():
        raise SystemExit("bench_kernel.py needs a CUDA device (or --dry-run on CPU)")
    else:
        device = torch.device("cuda")
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=__import__("triton").__version__, gb=args.gb)
    results = []
    print(f"{'scenario':8} {'pieces':>7} {'MB moved':>9} {'copy GB/s':>10} {'kernel GB/s':>12} "
          f"{'kernel/copy':>12} {'torch GB/s':>11} {'torch/copy':>11} {'kern vs torch':>14}")
    for name in args.scenarios.split(","):
        r = run_scenario(name, args, device)
        results.append(r)
        print(f"{name:8} {r['pieces']:>7} {r['moved_bytes'] / 1e6:>9.1f} {r['copy_gbps']:>10.1f} "
              f"{r['kernel_gbps']:>12.1f} {r['kernel_vs_copy']:>11.1%} {r.get('torch_gbps', 0):>11.1f} "
              f"{r.get('torch_vs_copy', 0):>10.1%} {r.get('kernel_speedup_vs_torch', 0):>13.1f}x", flush=True)
        if "diag" in r:
            g = r["diag"]
            print(f"    host ms/call {g['host_ms_call']:.3f} (uncached {g['host_ms_call_uncached']:.3f}); kernel alone "
                  + ", ".join(f"{o} {g[f'kernel_only_vs_copy_{o}']:.1%}" for o in TILE_ORDERS)
                  + "; call " + ", ".join(f"{o} {g[f'call_vs_copy_{o}']:.1%}" for o in TILE_ORDERS)
                  + f"; carved sources: kernel alone {g['kernel_only_vs_copy_carved']:.1%}, call "
                  f"{g['call_vs_copy_carved']:.1%}; uncached call {g['call_vs_copy_uncached']:.1%}; back to back "
                  f"{g['call_vs_copy_back_to_back']:.1%} (uncached {g['call_vs_copy_back_to_back_uncached']:.1%}); "
                  f"tiles {g['tiles'][TILE_ORDER]['sha256']}", flush=True)
        for cfg, ratio in r.get("sweep_kernel_vs_copy", {}).items():
            print(f"    sweep {cfg:24} kernel/copy {ratio:.1%}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, "bench_kernel.json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(info=info, results=results), f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
