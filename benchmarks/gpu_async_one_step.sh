#!/usr/bin/env bash
# One H200, colocated: rollout.async=off vs one_step vs stream on the SmolLM2 demo, each run being the demo's
# training command with its GPU recipe (examples/smollm2/grpo_addition.yaml + gpu.overrides: SGLang, bf16) on one
# GPU, for STEPS steps, alternating blocks so every mode sees the same machine state; then the comparison
# (benchmarks/async_compare.py). The trainer is started as examples/smollm2/run.sh starts it, without run.sh's
# summary step: that step needs an eval at step 0, which these timing runs leave out, so run.sh exited 1 after
# runs that had trained every step. Run from the repo root on the GPU machine after `source benchmarks/gpu_setup.sh`:
#   bash benchmarks/gpu_async_one_step.sh     (env: STEPS=12 REPEATS=2 STALENESS=1 OUT=/tmp/mtrain-async EXTRA="...")
# Prints one JSON object (also in $OUT/compare.json): per mode the step time (step_s, its spread over repeats),
# trained tokens/s, perf/engine_busy_frac, perf/train_wait_s, the reward curve; stream also rollout/pause_s,
# rollout/aborted_per_update (goal 0) and rollout/staleness_max/mean; then speedup_one_step, speedup_stream and the
# tokens/s ratios over off. one_step and stream keep the engine resident while training runs (engine.colocate's
# release is off): the trainer refuses at start, in one line, when training and the engine's mem_fraction_static
# cannot fit the GPU together (mtrain/trainer/memory_fit.py).
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-async}
mkdir -p "$out"
HF_DIR=${HF_DIR:-$(python -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
common="train.steps=${STEPS:-12} train.save_interval=-1 train.eval_interval=0 train.val_before_train=false
  train.resume=never"
mapfile -t recipe < <(grep -v '^[[:space:]]*\(#\|$\)' "$repo/examples/smollm2/gpu.overrides")
off=(); one=(); stream=(); failed=0
for rep in $(seq 1 "${REPEATS:-2}"); do
  for mode in off one_step stream; do
    run=$out/$mode-$rep
    rm -rf "$run"
    extra=""
    [ "$mode" = stream ] && extra="rollout.max_staleness=${STALENESS:-1}"
    TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 1 -m mtrain train \
        "$repo/examples/smollm2/grpo_addition.yaml" "${recipe[@]}" "model.hf_path=$HF_DIR" "train.run_dir=$run" \
        rollout.async=$mode $common $extra ${EXTRA:-} > "$run.log" 2>&1
    rc=$?
    # a run counts when the trainer exited 0 and its metrics hold every step (one "time/step" per step)
    trained=$(grep -c '"time/step"' "$run/metrics.jsonl" 2>/dev/null); trained=${trained:-0}
    echo "== $mode repeat $rep: trainer exit $rc, $trained of ${STEPS:-12} steps trained (log $run.log)"
    [ "$rc" -eq 0 ] && [ "$trained" -ge "${STEPS:-12}" ] || failed=$((failed + 1))
    case $mode in off) off+=("$run");; one_step) one+=("$run");; stream) stream+=("$run");; esac
  done
done
python "$repo/benchmarks/async_compare.py" --off "${off[@]}" --one-step "${one[@]}" --stream "${stream[@]}" --skip 2 \
  > "$out/compare.json"
rc=$?
cat "$out/compare.json"
# exit 0 exactly when every run trained all its steps and the comparison was made
echo "gpu_async_one_step.sh: $failed run(s) failed or short of ${STEPS:-12} steps; comparison exit $rc"
[ "$failed" -eq 0 ] && [ "$rc" -eq 0 ]
