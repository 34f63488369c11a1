#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2): separate placement, 1 training GPU + 1 engine GPU over NCCL.
#  1. benchmarks/gpu_separate_two_gpu.py: bit-equal shard-to-shard sync into the engine rank's SGLang layout, its time.
#  2. The SmolLM2 demo with SGLang: separate placement + rollout.async=one_step on 2 GPUs vs colocated synchronous on
#     1 GPU (benchmarks/async_compare.py: step time, trained tokens/s, perf/engine_busy_frac, perf/train_wait_s,
#     reward curve, ratio = the speed-up).
# Run from the repo root on the GPU machine after `source benchmarks/gpu_setup.sh`:
#   bash benchmarks/gpu_separate_two_gpu.sh            (env: STEPS=12 OUT=/tmp/mtrain-separate EXTRA="...")
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-separate}
mkdir -p "$out"
torchrun --nproc-per-node 2 "$repo/benchmarks/gpu_separate_two_gpu.py" | tee "$out/sync.json"
rcs=("sync check ${PIPESTATUS[0]}")
HF_DIR=${HF_DIR:-$(python -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
common="model.hf_path=$HF_DIR model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.3
  train.steps=${STEPS:-12} train.save_interval=-1 train.eval_interval=0 train.val_before_train=false
  train.resume=never rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=64
  rollout.max_groups_in_flight=32 train.micro_batch_size=32"
(cd "$out" && torchrun --nproc-per-node 1 -m mtrain train "$repo/examples/smollm2/grpo_addition.yaml" \
    train.run_dir="$out/colocated-sync" rollout.async=off $common ${EXTRA:-} > "$out/colocated-sync.log" 2>&1)
rc=$?; rcs+=("colocated $rc")
echo "== colocated sync (1 GPU): exit $rc"
(cd "$out" && torchrun --nproc-per-node 2 -m mtrain train "$repo/examples/smollm2/grpo_addition.yaml" \
    train.run_dir="$out/separate-one_step" engine.placement=separate engine.ranks=1 rollout.async=one_step \
    $common ${EXTRA:-} > "$out/separate-one_step.log" 2>&1)
rc=$?; rcs+=("separate $rc")
echo "== separate one_step (2 GPUs): exit $rc"
python "$repo/benchmarks/async_compare.py" --off "$out/colocated-sync" --one-step "$out/separate-one_step" --skip 2 \
  | tee "$out/compare.json"
rcs+=("comparison ${PIPESTATUS[0]}")
# exit 0 exactly when the sync check, both runs and the comparison exited 0
echo "gpu_separate_two_gpu.sh: ${rcs[*]}"
! printf '%s\n' "${rcs[@]}" | grep -qv ' 0$'
