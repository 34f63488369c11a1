#!/usr/bin/env bash
# The FP8 scatter kernel's knobs on the H200 (docs/results.md, "MoE bucket spread", FP8 part): rows per pass
# (MTRAIN_FP8_STEP_ROWS; 128 = the whole block in registers, one gather instead of two), warps per block
# (MTRAIN_FP8_WARPS), the GPU's own e4m3 conversion (MTRAIN_FP8_HW_CVT=1) and the fast path for blocks one
# sub-piece covers whole (MTRAIN_FP8_FAST; 0 = all blocks through the general path) and a register cap per thread
# (MTRAIN_FP8_MAXNREG: 64 at 16 warps, 128 at 8, let two blocks share an SM) and the division through the block's
# reciprocal (MTRAIN_FP8_RCP_DIV; 0 = one IEEE division per element) and the pipelined launch (MTRAIN_FP8_PIPELINE).
# Each run checks the Triton result
# against the torch executor bit for bit before timing (bit_equal_to_torch; exit 1 if not). From the repository
# root, .gpu/ carried, about 10 s per run (8 runs by default):
#   OUT=/tmp/fp8-sweep bash benchmarks/gpu_fp8_sweep.sh
set -uo pipefail
out=${OUT:-/tmp/fp8-sweep}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
# First the compiled kernel against the float64 reference on every bf16 / fp16 mantissa pair (the reciprocal
# division, RCP_DIV) and on the device-math cases; pytest from /tmp, as gpu_moe_spread.sh does.
repo=$(pwd)
(cd /tmp && python -m pytest -q -p no:cacheprovider "$repo/tests/kernels/test_fp8_rcp_div.py" \
    "$repo/tests/kernels/test_fp8_device_math.py") > "$out/fp8_exact_tests.txt" 2>&1
echo "fp8 exactness tests rc=$?"; tail -n 2 "$out/fp8_exact_tests.txt"
# FP8_SWEEP_MODELS: model[:train_tp] entries. qwen3moe:4 trains at TP4, so blocks straddle training shards and
# the general path runs beside the fast one (at TP2 every block of both tables is whole: the fast path alone).
for entry in ${FP8_SWEEP_MODELS:-llama8b qwen3moe}; do
    model=${entry%%:*} tp=$([[ $entry == *:* ]] && echo "${entry#*:}" || echo 2)
    layers=$([ "$model" = llama8b ] && echo 4 || echo 2)
    # step:warps:hw:fast[:maxnreg[:rcp[:pipeline]]] — 128:16:1:1:64:1:0 is the default (64 registers, reciprocal
    # division, one block per program); maxnreg 0 = no register cap, rcp 0 = one IEEE division per element,
    # pipeline N = the whole blocks' persistent launch with N stages (MTRAIN_FP8_PIPELINE). FP8_SWEEP_CFGS: a subset.
    # Earlier sweeps' settings: "32:4:0:1 32:4:1:1 128:8:0:1 128:8:1:1 64:8:1:1" (docs/results.md s. 34),
    # "128:16:1:0 64:16:1:1:0 128:16:1:1:64:0 128:16:1:1:0:1 128:8:1:1:128:1" (s. 36).
    # FP8_SWEEP_RUNS: processes per setting (the spread), 1 by default.
    for cfg in ${FP8_SWEEP_CFGS:-128:16:1:1:64:1:0 128:16:1:1:64:1:2 128:16:1:1:0:1:2 128:16:1:1:0:1:3}; do
      for run in $(seq 1 "${FP8_SWEEP_RUNS:-1}"); do
        IFS=: read -r step warps hw fast maxnreg rcp pipe <<< "$cfg"
        name="${model}_tp${tp}_s${step}_w${warps}_hw${hw}_f${fast}_r${maxnreg:-64}_d${rcp:-1}_p${pipe:-0}_run${run}"
        MTRAIN_FP8_STEP_ROWS=$step MTRAIN_FP8_WARPS=$warps MTRAIN_FP8_HW_CVT=$hw MTRAIN_FP8_FAST=$fast \
            MTRAIN_FP8_MAXNREG=${maxnreg:-64} MTRAIN_FP8_RCP_DIV=${rcp:-1} MTRAIN_FP8_PIPELINE=${pipe:-0} timeout -k 10 90 \
            python benchmarks/bench_fp8_kernel.py --model "$model" --layers "$layers" --train-tp "$tp" --reps 5 \
            > "$out/$name.json" 2> "$out/$name.err"
        rc=$?
        python3 - "$out/$name.json" "$name" "$rc" <<'PY' | tee -a "$out/summary.txt"
import json, sys
path, name, rc = sys.argv[1:]
try:
    txt = open(path).read()  # the bench's JSON, possibly after other output
    r = json.JSONDecoder().raw_decode(txt[txt.index('{\n "model"'):])[0]
    print(f"{name:46} rc={rc} bit_equal={r['bit_equal_to_torch']} fp8 {r['fp8_ms']:.3f} ms = {r['fp8_vs_floor']:.1%} "
          f"of floor; bf16 {r['bf16_ms']:.3f} ms = {r['bf16_vs_copy']:.1%} of copy | launches alone: fp8 "
          f"{r['fp8_gpu_only_ms']:.3f} ms = {r['fp8_gpu_only_vs_floor']:.1%} of floor, bf16 {r['bf16_gpu_only_ms']:.3f} "
          f"ms = {r['bf16_gpu_only_vs_copy']:.1%} of copy | host fp8 {r['fp8_host_ms']:.3f} bf16 {r['bf16_host_ms']:.3f} ms"
          f" | back to back: fp8 {r['fp8_back_to_back_vs_floor']:.1%} of floor, bf16 {r['bf16_back_to_back_vs_copy']:.1%}"
          f" | plain cast {r['cast_vs_floor']:.1%} of floor; fp8 vs cast: alone {r['fp8_gpu_only_vs_cast']:.1%}, "
          f"back to back {r['fp8_back_to_back_vs_cast']:.1%}")
except Exception as exc:  # a spill or compile error: say so and go on
    print(f"{name:46} rc={rc} no result ({type(exc).__name__})")
PY
      done
    done
done
