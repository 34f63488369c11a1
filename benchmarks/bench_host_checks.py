"""Host time of the piece kernel's per-call checks (`pieces.validate_call`) for bench_kernel's buckets, without and
with the last-call reuse: the host work that lands inside the MoE bucket's measured time (docs/results.md, section
"MoE bucket spread"). No kernel runs, so it measures the same on a CPU box as on the GPU host.

    python benchmarks/bench_host_checks.py --scenario moe --gb 2 --repeats 50
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import build  # noqa: E402
from mtrain.kernels import PieceTable  # noqa: E402
from mtrain.kernels.pieces import validate_call  # noqa: E402


def timed_ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def spread(runs: list[float]) -> dict:
    return {"median_ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs), "runs": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("dense", "moe"), default="moe")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bucket, dst_dt = build(args.scenario, args.gb * 1e9, tiny=False)
    # torch.empty touches no pages: the checks read only addresses, sizes, dtypes and strides
    srcs = [torch.empty(n, dtype=dt) for n, dt in zip(bucket.src_numels, bucket.src_dtypes)]
    dst = torch.empty(bucket.numel, dtype=dst_dt)
    table = PieceTable(torch.tensor(bucket.rows, dtype=torch.int64))
    validate_call(dst, srcs, table)  # the table's one-time validation, cached in both cases

    def cold():
        table.derived().pop("last_call", None)  # as before the reuse: every call checks every source
        validate_call(dst, srcs, table)

    res = {"scenario": args.scenario, "sources": len(srcs), "pieces": len(bucket.rows),
           "without_reuse": spread(timed_ms(cold, args.repeats)),
           "with_reuse": spread(timed_ms(lambda: validate_call(dst, srcs, table), args.repeats))}
    for k in ("without_reuse", "with_reuse"):
        s = res[k]
        print(f"validate_call {k:14s} median {s['median_ms']:.3f} ms ({s['min_ms']:.3f}-{s['max_ms']:.3f}, "
              f"{s['runs']} runs), {len(srcs)} sources")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
