#!/usr/bin/env bash
# PPO with a critic and on-policy distillation on the SmolLM2 addition task, with SGLang, on one GPU machine, from a
# plain checkout (BUILD.md, "GPU"), in one call of under 10 minutes. The GPU recipe (examples/smollm2/run.sh
# RECIPE=gpu, one rank per run):
#   teacher        GRPO, the recipe (evals every EVAL steps): the distillation teacher and the GRPO baseline curve
#   convert        its last checkpoint exported to HF (mtrain-convert mcore-to-hf)
#   then side by side on the one GPU (engine.mem_fraction_static=$MEM each, distinct rendezvous ports):
#   distill        the base model as student, the teacher's reverse KL alone as the signal (algo.distill.only=true)
#   distill_grpo   the same teacher term added to the GRPO advantage
#   ppo            algo.name=ppo: a critic from the policy's weights (critic.lr 1e-5)
# Then examples/smollm2/compare_runs.py prints, per run, the eval curve, the first eval step at the teacher's final
# accuracy, distill/reverse_kl (or the critic's value loss / explained variance) per step and the median step-time
# split (rollout / logprobs / train / sync).
#   bash benchmarks/gpu_ppo_distill.sh stage      # as gpu_smollm2.sh stage: set up, take the GGUF halves
#   bash benchmarks/gpu_ppo_distill.sh run        # the runs above; results in $OUT/ppo_distill_runs.tgz
# env: STEPS (28), EVAL (7), MEM (0.12), TEACHER_LIMIT (210 s), RUN_LIMIT (270 s): setup + both stay under 10 min
set -uo pipefail
source "$(dirname "$0")/smollm2_staged.sh" "${1:-}"  # set-up, the GGUF halves, HF_DIR
[ "${1:-}" = run ] || { echo "gpu_ppo_distill.sh: unknown action ${1:-} (stage | run)" >&2; exit 2; }
ROOT=/tmp/ppo_distill_runs; rm -rf "$ROOT"; mkdir -p "$ROOT"
COMMON=(train.steps=${STEPS:-28} train.eval_interval=${EVAL:-7})
launch() {  # name, port, limit, overrides...: one GPU-recipe run in the background (its pid in $last), log $ROOT/name.log
    local name=$1 port=$2 limit=$3; shift 3
    PET_MASTER_PORT=$port RECIPE=gpu NPROC=1 RUN_DIR=$ROOT/$name HF_DIR=$HF_DIR timeout "$limit" \
        bash examples/smollm2/run.sh "${COMMON[@]}" "$@" > "$ROOT/$name.log" 2>&1 &
    last=$!
}
failed=0
report() {  # name exit: one line per run; a run that exited non-zero counts as failed
    echo "== $1: exit $2, $(( $(date +%s) - t0 )) s: $(tail -n 2 "$ROOT/$1.log" | tr '\n' ' ')"
    [ "$2" -eq 0 ] || failed=$((failed + 1))
}
t0=$(date +%s)
# a checkpoint at the middle step too: if the limit cuts the run, the teacher is the latest one
launch teacher 29600 "${TEACHER_LIMIT:-210}" train.save_interval=$(( ${STEPS:-28} / 2 ))
wait "$last"; report teacher $?
ckpt=$ROOT/teacher/checkpoints/$(cat "$ROOT/teacher/checkpoints/latest" 2>/dev/null)/mcore
python3 -m mtrain.converters mcore-to-hf --mcore "$ckpt" --out "$ROOT/teacher_hf" --hf-config "$HF_DIR" --force \
    > "$ROOT/convert.log" 2>&1
rc=$?; [ $rc -eq 0 ] || failed=$((failed + 1))
echo "== convert: exit $rc, $(( $(date +%s) - t0 )) s: $ROOT/teacher_hf"
runs=(ppo)
[ -f "$ROOT/teacher_hf/config.json" ] && runs=(distill distill_grpo ppo)
pids=(); port=29610
for name in "${runs[@]}"; do
    case $name in
        distill) over=("algo.distill.teacher_path=$ROOT/teacher_hf" algo.distill.only=true) ;;
        distill_grpo) over=("algo.distill.teacher_path=$ROOT/teacher_hf") ;;
        ppo) over=(algo.name=ppo critic.lr=1.0e-5) ;;
    esac
    launch "$name" $port "${RUN_LIMIT:-270}" engine.mem_fraction_static=${MEM:-0.12} train.save_interval=-1 "${over[@]}"
    pids+=("$last")
    port=$((port + 7)); sleep 5
done
for i in "${!runs[@]}"; do wait "${pids[$i]}"; report "${runs[$i]}" $?; done
args=()
for name in teacher "${runs[@]}"; do [ -f "$ROOT/$name/metrics.jsonl" ] && args+=("$name=$ROOT/$name"); done
python3 examples/smollm2/compare_runs.py "${args[@]}" --out "$ROOT/compare" | tee "$OUT/ppo_distill_compare.txt"
tar --exclude='checkpoints' --exclude='teacher_hf' -czf "$OUT/ppo_distill_runs.tgz" -C /tmp ppo_distill_runs
echo "gpu_ppo_distill.sh: $failed step(s) failed"
[ "$failed" -eq 0 ]
