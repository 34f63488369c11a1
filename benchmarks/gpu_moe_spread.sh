#!/usr/bin/env bash
# Issue 15.4, the MoE bucket's run-to-run spread (docs/results.md, "MoE bucket spread"), in one device call. From
# the repository root on the H200 (the usual .gpu/ environment carried; about 4 minutes):
#   OUT=/tmp/moe-spread bash benchmarks/gpu_moe_spread.sh
# 1. the compiled kernel == torch executor (incl. repeated calls on new sources, a side stream, both tile orders);
# 2. five separate processes of bench_kernel.py (dense, moe) with PYTHONHASHSEED 1..5, each recording the host time
#    of a call, the kernel alone in both tile orders, the call before the host caches, the same sources carved
#    from one allocation, the tile fingerprint and the address alignment (benchmarks/kernel_diag.py);
# 3. one moe-only process (fresh allocations, as in the second session's 47-50 % runs);
# 4. the FP8/bf16 scatter bench on the Qwen3-MoE table (execute_scatter's host cache shows in bf16_ms).
# Then one line per run (kernel_diag's fields) in $OUT/summary.txt, and per run the kernel alone on each class of
# pieces (row-contiguous, strided; bench_kernel.piece_classes). A quick look at one process, ~1.5 min:
#   MOE_SPREAD_RUNS=1 MOE_SPREAD_EXTRA=0 OUT=/tmp/moe-spread bash benchmarks/gpu_moe_spread.sh
set -uo pipefail
out=${OUT:-/tmp/moe-spread}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1  # mtrain (and megatron-core for the FP8 bench's planner) importable
repo=$(pwd)  # pytest from /tmp: the checkout's mtrain/ (no mtrain.kernels mapping) must not shadow gpu_setup's copy
(cd /tmp && python -m pytest -q -p no:cacheprovider "$repo/tests/kernels/test_kernels_cuda.py") > "$out/cuda_tests.txt" 2>&1
echo "cuda tests rc=$?"; tail -n 2 "$out/cuda_tests.txt"
for i in ${MOE_SPREAD_RUNS:-1 2 3 4 5}; do  # MOE_SPREAD_RUNS="1": one process (a quick look)
    mkdir -p "$out/run$i"
    PYTHONHASHSEED=$i OUT="$out/run$i" timeout -k 10 150 python benchmarks/bench_kernel.py --gb 2 --no-sweep \
        --scenarios dense,moe --diag-only > "$out/run$i/log.txt" 2>&1
    echo "run$i rc=$?"
done
if [ "${MOE_SPREAD_EXTRA:-1}" != 0 ]; then  # MOE_SPREAD_EXTRA=0: without the moe-only and FP8 processes
    mkdir -p "$out/moe_only"
    OUT="$out/moe_only" timeout -k 10 150 python benchmarks/bench_kernel.py --gb 2 --no-sweep --scenarios moe --diag-only \
        > "$out/moe_only/log.txt" 2>&1
    echo "moe_only rc=$?"
    OUT="$out" timeout -k 10 150 python benchmarks/bench_fp8_kernel.py --model qwen3moe --layers 2 > "$out/fp8_qwen3moe.txt" 2>&1
    echo "fp8 qwen3moe rc=$?"
fi
python - "$out" <<'PY' | tee "$out/summary.txt"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*", "bench_kernel.json"))):
    for r in json.load(open(path))["results"]:
        g = r.get("diag", {})
        if not g:
            continue
        src = g["src_addresses"]
        print(f"{os.path.basename(os.path.dirname(path)):8} {r['scenario']:5} call/copy {r['kernel_vs_copy']:.3f} "
              f"host {g['host_ms_call']:.3f} ms (uncached {g['host_ms_call_uncached']:.3f}) | kernel alone "
              f"table {g['kernel_only_vs_copy_table']:.3f} dst {g['kernel_only_vs_copy_dst']:.3f} carved "
              f"{g['kernel_only_vs_copy_carved']:.3f} 16384x512 table {g['kernel_only_vs_copy_table_16384x512']:.3f} dst "
              f"{g['kernel_only_vs_copy_dst_16384x512']:.3f} | call table {g['call_vs_copy_table']:.3f} dst "
              f"{g['call_vs_copy_dst']:.3f} carved {g['call_vs_copy_carved']:.3f} uncached "
              f"{g['call_vs_copy_uncached']:.3f} | back-to-back {g['call_vs_copy_back_to_back']:.3f} "
              f"(uncached {g['call_vs_copy_back_to_back_uncached']:.3f}) | tiles {g['tiles']['table']['sha256']} "
              f"src span {src['span_gb']:.2f} GB, mod4096 residues {len(src['mod4096'])}, segments "
              f"{g.get('allocator', {}).get('segment.all.current')} | load {g['host']['loadavg'][0]:.1f} "
              f"cpu {g['host'].get('cpu_now')}")
        for cls, c in g.get("piece_classes", {}).items():  # the kernel alone on each class of pieces
            print(f"{'':8} {r['scenario']:5}   {cls:10} {c['pieces']:5d} pieces {c['elements'] / 1e6:8.1f} M elements: "
                  + " ".join(f"{k.replace('kernel_only_vs_copy_', '')} {v:.3f}" for k, v in c.items()
                             if k.startswith("kernel_only")))
PY
