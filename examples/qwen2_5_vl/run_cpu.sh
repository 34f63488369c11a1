#!/usr/bin/env bash
# Tiny Qwen2.5-VL GRPO on CPU: write the model (once), then train. Extra arguments are config overrides.
#   bash examples/qwen2_5_vl/run_cpu.sh [key=value ...]        NPROC=2 for two ranks (e.g. parallel.tp=2)
#   env: WORK (model and run, default runs/tiny_vlm), RUN_DIR (the run, default $WORK/run; train.resume is auto, so a
#   finished run in it has nothing left to do: give another RUN_DIR for another layout)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(realpath -m "${WORK:-$repo/runs/tiny_vlm}")
run=$(realpath -m "${RUN_DIR:-$work/run}")
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
mkdir -p "$work"
cd "$work"  # outside the checkout: the installed package (with mtrain.kernels) is what runs
[ -f "$work/hf/config.json" ] || python -m mtrain init-tiny --arch qwen2_5_vl --out "$work/hf"
python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-1}" -m mtrain train "$repo/examples/qwen2_5_vl/tiny_cpu.yaml" \
    model.hf_path="$work/hf" train.run_dir="$run" "$@"
echo "metrics: $run/metrics.jsonl"
