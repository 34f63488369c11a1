#!/usr/bin/env bash
# The compiled FP8 kernel against the float64 reference on every bf16 / fp16 mantissa pair
# (tests/kernels/fp8_mantissa_blocks.py), with and without the reciprocal division, the GPU's e4m3 conversion and the
# pipelined launch, so that a difference names its step; plus the conversion alone on e4m3 midpoints and values
# above 448. From the repository root, .gpu/ carried:   OUT=/tmp/fp8-exact bash benchmarks/gpu_fp8_exact.sh
set -uo pipefail
out=${OUT:-/tmp/fp8-exact}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
repo=$(pwd)
for cfg in ${FP8_EXACT_CFGS:-1:1:0 1:1:3 0:1:0 1:0:0}; do  # rcp_div:hw_cvt:pipeline
    IFS=: read -r rcp hw pipe <<< "$cfg"
    (cd /tmp && MTRAIN_FP8_RCP_DIV=$rcp MTRAIN_FP8_HW_CVT=$hw MTRAIN_FP8_PIPELINE=${pipe:-0} TRITON_INTERPRET=0 \
        PYTHONPATH="$repo/tests/kernels:${PYTHONPATH:-}" timeout -k 10 240 python "$repo/tests/kernels/fp8_mantissa_blocks.py") \
        2>&1 | tee "$out/exact_rcp${rcp}_hw${hw}_p${pipe:-0}.txt"
    echo "rcp_div:hw_cvt:pipeline $cfg rc=$?"
done
