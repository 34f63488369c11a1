#!/usr/bin/env bash
# The FP8 scatter kernel's knobs on the H200 (docs/results.md, "MoE bucket spread", FP8 part): rows per pass
# (MTRAIN_FP8_STEP_ROWS; 128 = the whole block in registers, one gather instead of two), warps per block
# (MTRAIN_FP8_WARPS) and the GPU's own e4m3 conversion (MTRAIN_FP8_HW_CVT=1). Each run checks the Triton result
# against the torch executor bit for bit before timing (bit_equal_to_torch; exit 1 if not). From the repository
# root, .gpu/ carried, about 4 minutes (12 runs):
#   OUT=/tmp/fp8-sweep bash benchmarks/gpu_fp8_sweep.sh
set -uo pipefail
out=${OUT:-/tmp/fp8-sweep}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
for model in llama8b qwen3moe; do
    layers=$([ "$model" = llama8b ] && echo 4 || echo 2)
    # step:warps:hw — today's default first, then one knob at a time, then together
    for cfg in 32:4:0 32:4:1 128:8:0 128:8:1 128:16:1 64:8:1; do
        IFS=: read -r step warps hw <<< "$cfg"
        name="${model}_s${step}_w${warps}_hw${hw}"
        MTRAIN_FP8_STEP_ROWS=$step MTRAIN_FP8_WARPS=$warps MTRAIN_FP8_HW_CVT=$hw timeout -k 10 90 \
            python benchmarks/bench_fp8_kernel.py --model "$model" --layers "$layers" --reps 5 \
            > "$out/$name.json" 2> "$out/$name.err"
        rc=$?
        python3 - "$out/$name.json" "$name" "$rc" <<'PY' | tee -a "$out/summary.txt"
import json, sys
path, name, rc = sys.argv[1:]
try:
    txt = open(path).read()  # the bench's JSON, possibly after other output
    r = json.JSONDecoder().raw_decode(txt[txt.index('{\n "model"'):])[0]
    print(f"{name:28} rc={rc} bit_equal={r['bit_equal_to_torch']} fp8 {r['fp8_ms']:.3f} ms = {r['fp8_vs_floor']:.1%} "
          f"of floor; bf16 {r['bf16_ms']:.3f} ms = {r['bf16_vs_copy']:.1%} of copy")
except Exception as exc:  # a spill or compile error: say so and go on
    print(f"{name:28} rc={rc} no result ({type(exc).__name__})")
PY
    done
done
