"""Host work of one execute_scatter call on the planner's real tables, on the CPU box: bf16 and FP8 destinations.

    python benchmarks/bench_scatter_host.py --model qwen3moe --layers 2     # writes $OUT/bench_scatter_host_*.json
    python benchmarks/bench_scatter_host.py --model llama8b --layers 4

What a sync's call costs the host before its GPU work can start: checks, plans, launch arguments, or, when the
call repeats the previous one, the sweep that proves it does and the replay (kernels/scatter_fp8.py). On the GPU
bench_fp8_kernel.py measures the same as *_host_ms, launches included; this runs the compiled mode's host code on
the CPU instead, so a change to that code can be measured without a GPU: the Triton kernels are replaced by no-op
launchers and the CUDA-only calls (interpretation flag, current stream) by their CPU stand-ins. What it leaves out:
Triton's own launcher (tens of microseconds per launch on the H200) and the CUDA driver. Timings are medians of
--reps calls after one warm-up call (the first call of a table prepares everything: reported separately).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fp8_kernel  # noqa: E402  (benchmarks/: the same planner tables as the GPU benchmark)


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Stream:
    cuda_stream = 0


def host_mode() -> None:
    """The compiled mode's host code, without kernels or CUDA."""
    from mtrain.kernels import triton_fp8 as tf
    from mtrain.kernels import triton_pieces as tp

    tf._fp8_blocks_kernel = tp._pieces_kernel = _NoLaunch()
    tf.is_interpreted = tp.is_interpreted = lambda: False
    tp.check_device = lambda dst: None
    torch.cuda.current_stream = lambda device=None: _Stream()


def median_ms(fn, reps: int) -> tuple[float, float, float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(bench_fp8_kernel.SHAPES), default="qwen3moe")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--train-tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    host_mode()
    from mtrain.kernels import BlockFp8, ScatterTable, execute_scatter
    from mtrain.kernels.fp8 import FP8

    table, targets, quant, srcs = bench_fp8_kernel.build(args.model, args.layers, args.train_tp, torch.device("cpu"),
                                                          False)
    fp8 = [torch.empty(s, dtype=FP8).view(-1) for _, s in targets]
    specs = {i: BlockFp8(torch.empty(q.scale_shape).view(-1), tuple(targets[i][1]), q.block) for i, q in quant.items()}
    bf16 = [torch.empty(s, dtype=torch.bfloat16).view(-1) for _, s in targets]
    res = dict(model=args.model, layers=args.layers, train_tp=args.train_tp, sources=len(srcs), params=len(targets),
               reps=args.reps, machine=os.uname().nodename)
    for name, dsts, quant_arg in (("fp8", fp8, specs), ("bf16", bf16, None)):
        fresh = ScatterTable(table.table, table.dst_index)  # its own caches: the first call prepares everything
        call = lambda: execute_scatter(dsts, srcs, fresh, backend="triton", quant=quant_arg)  # noqa: E731
        t0 = time.perf_counter()
        call()
        res[f"{name}_first_call_ms"] = (time.perf_counter() - t0) * 1e3
        res[f"{name}_repeat_ms"], res[f"{name}_repeat_min_ms"], res[f"{name}_repeat_max_ms"] = median_ms(call, args.reps)
        if quant_arg:  # the repeats were replays of the first call's launches
            res["fp8_replay_kept"] = fresh.derived().get("fp8_replay") is not None
    print(json.dumps(res, indent=1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"bench_scatter_host_{args.model}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
