#!/usr/bin/env bash
# The tiny task's learning curve: synchronous colocated (2 gloo ranks, DP 2, 2 reference engines on the same ranks)
# vs separate placement with rollout.async=one_step (4 gloo ranks: 2 training ranks DP 2 + 2 engine ranks), over
# several seeds, then the comparison (benchmarks/async_compare.py: reward curve, step time, perf/engine_busy_frac,
# perf/train_wait_s):
#   bash benchmarks/separate_curve_cpu.sh [STEPS] [SEEDS...]        (env: OUT, default runs/separate_curve)
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
STEPS=${1:-8}; shift || true
SEEDS=${*:-1 2 3}
OUT=${OUT:-runs/separate_curve}
HF=$OUT/hf
[ -f "$HF/config.json" ] || python -c "from mtrain.tiny_hf import write_tiny_hf; write_tiny_hf('llama', '$HF', seed=0)"
col=(); sep=()
for seed in $SEEDS; do
  for mode in colocated separate; do
    run=$OUT/$mode-seed$seed
    rm -rf "$run"
    if [ "$mode" = colocated ]; then nproc=2; extra=(rollout.async=off)
    else nproc=4; extra=(engine.placement=separate engine.ranks=2 rollout.async=one_step); fi
    torchrun --standalone --nproc-per-node $nproc -m mtrain train mtrain/configs/tiny_llama_grpo.yaml \
      "model.hf_path=$HF" "train.run_dir=$run" "train.steps=$STEPS" train.save_interval=-1 train.eval_interval=0 \
      "train.seed=$seed" "data.seed=$seed" optim.lr=1e-4 "${extra[@]}" > "$run.log" 2>&1 || { tail -30 "$run.log"; exit 1; }
    if [ "$mode" = colocated ]; then col+=("$run"); else sep+=("$run"); fi
  done
done
python benchmarks/async_compare.py --off "${col[@]}" --one-step "${sep[@]}"
