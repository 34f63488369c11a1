"""The block-FP8 scatter kernel alone vs the bf16 scatter of the same pieces vs a plain copy, on planner tables.

    python benchmarks/bench_fp8_kernel.py --model llama8b --layers 4      # H200; writes $OUT/bench_fp8_kernel_*.json
    python benchmarks/bench_fp8_kernel.py --model qwen3moe --layers 2
    python benchmarks/bench_fp8_kernel.py --dry-run                      # CPU, TRITON_INTERPRET=1, tiny shapes

The table is the real one: the planner's pieces from Megatron shards (training TP --train-tp, every shard its own
allocation unless --contiguous) into an engine's linear weights at engine TP 1 (the FP8 destinations only, so
the FP8 launch is what is timed). Four timings in one run: (a) execute_scatter with quant= into float8_e4m3fn
parameters + their weight_scale_inv, (b) the same table into bf16 parameters (today's bf16 sync kernel), (c) one
plain torch copy_ of the same element count, bf16 -> bf16 (the bandwidth baseline), (d) torch's plain bf16 ->
float8_e4m3fn cast of that count (no scales: the FP8 byte pattern's own copy, *_vs_cast). FP8 reads 2 bytes and
writes 1 per weight, so its floor is 3/4 of the bf16 one at the same bandwidth: fp8_vs_floor = floor / time.
Correctness first: the Triton result equals the torch executor's, bit for bit, weights and scales. (a) and (b) are
also split into the host work of a call and the GPU time of its launches alone (*_host_ms, *_gpu_only_ms), and
timed back to back (*_back_to_back_ms: host work overlapping the previous call's GPU work, as bench_kernel.py's
bf16 figures).
Run it 5 times for the run-to-run spread (the MoE bf16 bucket was bimodal, docs/results.md). The kernel's knobs
come from the environment (MTRAIN_FP8_STEP_ROWS, _WARPS, _HW_CVT, _MAXNREG, _RCP_DIV, _PIPELINE; MTRAIN_FP8_FAST=0 sends the blocks one sub-piece
covers whole through the general path too) and are recorded in the JSON with the count of such blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_diag  # noqa: E402  (benchmarks/, next to this file)

SHAPES = {
    "llama8b": dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3moe": dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=128, tie_word_embeddings=False),
}


def build(model: str, layers: int, train_tp: int, device, contiguous: bool):
    """(scatter table of the FP8 destinations, dst shapes, quant specs' (scale shape), sources)."""
    from mtrain.kernels import ScatterTable
    from mtrain.layouts import model_layout
    from mtrain.reshard.executor import Executor
    from mtrain.reshard.placement import MegatronLayout, SGLangLayout
    from mtrain.reshard.planner import build_plan
    from mtrain.reshard.pull import PullPlan

    cfg = dict(SHAPES[model], num_hidden_layers=layers)
    layout = model_layout(cfg)
    layout.weights = [w for w in layout.weights if w.block_fp8]
    plan = build_plan(layout, MegatronLayout(tp=train_tp), SGLangLayout(tp=1, fp8=True), colocate=lambda r: 0)
    numels = {k: int(torch.tensor(ref.shape).prod()) for k, ref in plan.src_tensors.items()}
    if contiguous:
        flat = torch.randn(sum(numels.values()), device=device).to(torch.bfloat16) * 0.02
        srcs, off = {}, 0
        for k, ref in plan.src_tensors.items():
            srcs[k] = flat[off:off + numels[k]].view(ref.shape)
            off += numels[k]
    else:
        srcs = {k: (torch.randn(ref.shape, device=device) * 0.02).to(torch.bfloat16) for k, ref in plan.src_tensors.items()}
    ex = Executor(plan, 0, lambda ref: srcs[(ref.rank, ref.chunk, ref.name)], dtype=torch.bfloat16,
                  src_everywhere=True, backend="torch", device=device)
    (jobs,) = list(PullPlan(ex).jobs())
    job = jobs[0]
    return ScatterTable.from_rows(job.rows), job.targets, job.quant, [s.view(-1) for s in job.sources]


def timed(fn, reps: int, device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def back_to_back(fn, reps: int, device) -> float:
    """Seconds per call over `reps` calls issued back to back, one synchronisation at the end: the host work of a
    call overlaps the GPU's work of the previous one, as when a sync issues its buckets one after another (and as
    bench_kernel.py's `call` figure for the bf16 buckets, which uses triton.testing.do_bench)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train-tp", type=int, default=2)
    ap.add_argument("--contiguous", action="store_true", help="Megatron shards carved from one buffer")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, the tiny shape")
    args = ap.parse_args()
    if args.dry_run:
        args.model, args.layers, args.reps = "tiny", 1, 1
    from mtrain.kernels import BlockFp8, execute_scatter
    from mtrain.kernels.fp8 import FP8

    device = torch.device("cpu" if args.dry_run else "cuda")
    table, targets, quant, srcs = build(args.model, args.layers, args.train_tp, device, args.contiguous)
    n = sum(int(torch.tensor(s).prod()) for _, s in targets)
    # zeros, not empty: bytes no piece covers (if any) must compare equal between the two executors, whatever the
    # allocator hands back (the suite once saw the dry run unequal, not reproduced alone)
    fp8 = [torch.zeros(s, dtype=FP8, device=device).view(-1) for _, s in targets]
    scales = {i: torch.zeros(q.scale_shape, device=device).view(-1) for i, q in quant.items()}
    specs = {i: BlockFp8(scales[i], tuple(targets[i][1]), q.block) for i, q in quant.items()}
    bf16 = [torch.empty(s, dtype=torch.bfloat16, device=device).view(-1) for _, s in targets]
    assert len(quant) == len(targets)

    # correctness: Triton == torch executor, weights and scales
    execute_scatter(fp8, srcs, table, backend="triton", quant=specs)
    got = ([t.view(torch.uint8).clone() for t in fp8], [s.clone() for s in scales.values()])
    ref_w = [torch.zeros_like(t) for t in fp8]
    ref_s = {i: torch.zeros_like(s) for i, s in scales.items()}
    execute_scatter(ref_w, srcs, table, backend="torch",
                    quant={i: BlockFp8(ref_s[i], specs[i].shape, specs[i].block) for i in specs})
    exact = all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(got[0], ref_w)) and \
        all(torch.equal(a, b) for a, b in zip(got[1], ref_s.values()))

    fp8_call = lambda: execute_scatter(fp8, srcs, table, backend="triton", quant=specs)  # noqa: E731
    bf16_call = lambda: execute_scatter(bf16, srcs, table, backend="triton")  # noqa: E731
    t_fp8 = timed(fp8_call, args.reps, device)
    t_bf16 = timed(bf16_call, args.reps, device)
    # The timings above are whole calls, host work included, as a sync pays them; these split a call into its host
    # work (GPU idle at the start) and its launches' GPU time (kernel_diag.gpu_only_ms).
    split = {f"{name}_{kind}_ms": fn(call, device) for name, call in (("fp8", fp8_call), ("bf16", bf16_call))
             for kind, fn in (("host", kernel_diag.host_ms), ("gpu_only", kernel_diag.gpu_only_ms))}
    split.update({f"{name}_back_to_back_ms": back_to_back(call, 4 * args.reps, device) * 1e3
                  for name, call in (("fp8", fp8_call), ("bf16", bf16_call))})
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    t_copy = timed(lambda: b.copy_(a), args.reps, device)
    bw = 4 * n / t_copy  # bytes read + written per second by a bf16 copy
    # The same byte pattern as the FP8 kernel (read 2 bytes, write 1, per weight) without the blocks' scales: torch's
    # own elementwise bf16 -> float8_e4m3fn cast. What the memory system gives that pattern, measured in this run, is
    # the FP8 destinations' counterpart of the bf16 copy (the 3/4 floor assumes a 2:1 read/write mix moves as fast).
    c = torch.empty(n, dtype=FP8, device=device)
    cast = lambda: c.copy_(a)  # noqa: E731
    t_cast = timed(cast, args.reps, device)
    t_cast_b2b = back_to_back(cast, 4 * args.reps, device)
    from mtrain.kernels import triton_fp8 as tf
    from mtrain.kernels.fp8 import WHOLE
    from mtrain.kernels.scatter_fp8 import _split

    blocks = [b for b, _, _ in _split(table, specs)[1].values()]
    res = dict(model=args.model, layers=args.layers, train_tp=args.train_tp, contiguous=args.contiguous,
               params=len(targets), sources=len(srcs), elements=n, bit_equal_to_torch=exact,
               knobs=dict(step_rows=tf.STEP_ROWS, warps=tf.WARPS, hw_cvt=tf.HW_CVT, fast_path=tf.FAST_PATH,
                          maxnreg=tf.MAXNREG, rcp_div=tf.RCP_DIV, pipeline=tf.PIPELINE),
               blocks=sum(len(b) for b in blocks), whole_blocks=sum(int(b[:, WHOLE].sum()) for b in blocks),
               copy_GBps=bw / 1e9, fp8_ms=t_fp8 * 1e3, bf16_ms=t_bf16 * 1e3, copy_ms=t_copy * 1e3,
               fp8_vs_floor=(3 * n / bw) / t_fp8, bf16_vs_copy=t_copy / t_bf16, fp8_over_bf16=t_fp8 / t_bf16,
               **split, fp8_gpu_only_vs_floor=(3 * n / bw) / (split["fp8_gpu_only_ms"] / 1e3),
               bf16_gpu_only_vs_copy=t_copy / (split["bf16_gpu_only_ms"] / 1e3),
               fp8_back_to_back_vs_floor=(3 * n / bw) / (split["fp8_back_to_back_ms"] / 1e3),
               bf16_back_to_back_vs_copy=t_copy / (split["bf16_back_to_back_ms"] / 1e3),
               cast_ms=t_cast * 1e3, cast_back_to_back_ms=t_cast_b2b * 1e3, cast_vs_floor=(3 * n / bw) / t_cast_b2b,
               fp8_gpu_only_vs_cast=t_cast_b2b / (split["fp8_gpu_only_ms"] / 1e3),
               fp8_back_to_back_vs_cast=t_cast_b2b / (split["fp8_back_to_back_ms"] / 1e3),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)")
    # Where the sources live (the bf16 MoE bucket ran at ~50 % or ~81 % of copy bandwidth depending on it,
    # docs/archive/results-2026-11.md section 1): allocator segments and the address span the sources cover.
    ptrs = sorted(t.data_ptr() for t in srcs)
    res["sources_span_GB"] = (ptrs[-1] - ptrs[0]) / 1e9 if ptrs else 0.0
    if device.type == "cuda":
        res["allocator_segments"] = torch.cuda.memory_stats(device).get("segment.all.current")
    print(json.dumps(res, indent=1))
    out = os.environ.get("OUT")
    if out:
        name = f"bench_fp8_kernel_{args.model}{'_contiguous' if args.contiguous else ''}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
