#!/usr/bin/env bash
# The tiny task's learning curve, synchronous vs rollout.async=one_step vs stream, over several seeds (CPU, 2 gloo ranks,
# reference engines), then the comparison (benchmarks/async_compare.py):
#   bash benchmarks/async_curve_cpu.sh [STEPS] [SEEDS...]        (env: OUT, default runs/async_curve)
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
STEPS=${1:-12}; shift || true
SEEDS=${*:-1 2 3}
OUT=${OUT:-runs/async_curve}
HF=$OUT/hf
[ -f "$HF/config.json" ] || python -c "from mtrain.tiny_hf import write_tiny_hf; write_tiny_hf('llama', '$HF', seed=0)"
off=(); one=(); stream=()
for seed in $SEEDS; do
  for mode in off one_step stream; do
    run=$OUT/$mode-seed$seed
    rm -rf "$run"
    torchrun --standalone --nproc-per-node 2 -m mtrain train mtrain/configs/tiny_llama_grpo.yaml "model.hf_path=$HF" \
      "train.run_dir=$run" "train.steps=$STEPS" train.save_interval=-1 train.eval_interval=0 "train.seed=$seed" \
      "data.seed=$seed" "rollout.async=$mode" optim.lr=1e-4 > "$run.log" 2>&1 || { tail -30 "$run.log"; exit 1; }
    case $mode in off) off+=("$run");; one_step) one+=("$run");; stream) stream+=("$run");; esac
  done
done
python benchmarks/async_compare.py --off "${off[@]}" --one-step "${one[@]}" --stream "${stream[@]}"
