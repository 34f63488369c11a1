#!/usr/bin/env bash
# FP8 rollout (issue 15) and partial rollout (issue 11) on one H200; results into $OUT. From the repo root, `.gpu/`
# carried. PARTS picks: fp8 (sync vs bf16 + bit-equality, tiny DeepSeek-V3 and Llama-8B), fp8loop (GRPO with an FP8
# engine), partial (synchronous vs partial rollout on the longtail task).
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-round2}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
parts=" ${PARTS:-fp8 fp8loop partial} "
step() {  # name timeout cmd...
    local name=$1 t=$2; shift 2
    (OUT=$out timeout "$t" "$@" > "$out/log_$name.txt" 2>&1)
    echo "== $name: exit $?"
    grep -v -i "warn" "$out/log_$name.txt" | grep -v "steps:" | tail -n 14
}
if [[ $parts == *" fp8 "* ]]; then
    step fp8_dsv3tiny 240 python benchmarks/gpu_fp8_sync.py --out "$out" --model dsv3tiny --disk --diag-rows 0
    step fp8_llama8b 420 python benchmarks/gpu_fp8_sync.py --out "$out" --model llama8b --contiguous-params
fi
if [[ $parts == *" fp8loop "* ]]; then
    (OUT=$out STEPS=3 EXTRA="engine.weight_dtype=fp8" MODELS=dsv3 timeout 200 bash benchmarks/gpu_rl_loop.sh \
        > "$out/log_fp8loop_wrapper.txt" 2>&1); echo "== fp8loop: exit $?"; tail -n 8 "$out/log_fp8loop_wrapper.txt"
fi
if [[ $parts == *" partial "* ]]; then
    work=/tmp/mtrain-partial-hf && rm -rf "$work"
    (cd /tmp && python -m mtrain init-tiny --out "$work" --arch llama --set hidden_size=512 head_dim=64 \
        num_attention_heads=8 num_key_value_heads=2 intermediate_size=1024 vocab_size=4096 max_position_embeddings=2048 >/dev/null)
    (cd /tmp && step partial 420 python "$repo/benchmarks/bench_partial_rollout.py" --hf "$work" --steps 6 \
        --prompts 32 --samples 8 --over-sample 2 model.dtype=bfloat16 engine.kind=sglang train.micro_batch_size=32 \
        engine.mem_fraction_static=0.3 rollout.max_new_tokens=1024 data.longtail.median_count=20)
fi
