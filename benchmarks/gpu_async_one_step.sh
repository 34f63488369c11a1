#!/usr/bin/env bash
# One H200, colocated: rollout.async=one_step vs synchronous on the SmolLM2 demo (examples/smollm2/grpo_addition.yaml
# with SGLang, bf16), alternating blocks so both modes see the same machine state; then the comparison
# (benchmarks/async_compare.py: step time, trained tokens/s, engine_busy_frac, train_wait_s, reward curve, ratio).
# Run from the repo root on the GPU machine after `source benchmarks/gpu_setup.sh`:
#   bash benchmarks/gpu_async_one_step.sh            (env: STEPS=12 REPEATS=2 OUT=/tmp/mtrain-async EXTRA="...")
# one_step keeps the engine resident while training runs (engine.colocate's release is off): the engine's
# mem_fraction_static and the trainer's memory must fit the GPU together.
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-async}
mkdir -p "$out"
HF_DIR=${HF_DIR:-$(python -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
common="model.hf_path=$HF_DIR model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.3
  train.steps=${STEPS:-12} train.save_interval=-1 train.eval_interval=0 train.val_before_train=false
  train.resume=never rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=64
  rollout.max_groups_in_flight=32 train.micro_batch_size=32"
off=(); one=()
for rep in $(seq 1 "${REPEATS:-2}"); do
  for mode in off one_step; do
    run=$out/$mode-$rep
    rm -rf "$run"
    # outside the checkout, as benchmarks/gpu_rl_loop.sh: the installed package maps mtrain.kernels/converters
    (cd "$out" && torchrun --nproc-per-node 1 -m mtrain train "$repo/examples/smollm2/grpo_addition.yaml" \
        train.run_dir="$run" rollout.async=$mode $common ${EXTRA:-} > "$run.log" 2>&1)
    echo "== $mode repeat $rep: exit $?"
    if [ "$mode" = off ]; then off+=("$run"); else one+=("$run"); fi
  done
done
python "$repo/benchmarks/async_compare.py" --off "${off[@]}" --one-step "${one[@]}" --skip 2 | tee "$out/compare.json"
