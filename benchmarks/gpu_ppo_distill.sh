#!/usr/bin/env bash
# PPO with a critic and on-policy distillation on the SmolLM2 addition task, with SGLang, on one GPU machine, from a
# plain checkout (BUILD.md, "GPU"). Four runs of the GPU recipe (examples/smollm2/run.sh RECIPE=gpu, one rank per
# GPU):
#   grpo      the recipe (the distillation teacher, and the baseline the other curves are compared with)
#   ppo       algo.name=ppo: a critic from the policy's weights (critic.lr 1e-5)
#   teacher   grpo's last checkpoint exported to HF (mtrain-convert mcore-to-hf)
#   distill   the base model as student, grpo's policy as teacher, distillation added to the GRPO advantage
# Then it prints each run's eval curve and the median step-time split (rollout / logprobs / train / sync).
#   bash benchmarks/gpu_ppo_distill.sh stage      # as gpu_smollm2.sh stage: set up, take the GGUF halves
#   bash benchmarks/gpu_ppo_distill.sh run        # the four steps above; results in $OUT/ppo_distill_runs.tgz
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh || exit 1
export MTRAIN_CACHE=${MTRAIN_CACHE:-/tmp/mtrain-cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/stage_smollm2.py take; rc=$?
[ "${1:-}" = stage ] && exit 0
[ $rc -ne 0 ] && { echo "gpu_ppo_distill.sh: the GGUF is not in place (stage_smollm2.py exit $rc)" >&2; exit 1; }
HF_DIR=$(python3 -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" 2>/dev/null | tail -n 1)
[ -f "$HF_DIR/config.json" ] || { echo "gpu_ppo_distill.sh: conversion failed" >&2; exit 1; }
[ "${1:-}" = run ] || { echo "gpu_ppo_distill.sh: unknown action ${1:-} (stage | run)" >&2; exit 2; }
ROOT=/tmp/ppo_distill_runs; mkdir -p "$ROOT"
one() {  # name, overrides...
    local name=$1; shift
    RECIPE=gpu RUN_DIR=$ROOT/$name HF_DIR=$HF_DIR timeout ${RUN_LIMIT:-900} bash examples/smollm2/run.sh "$@" \
        > "$ROOT/$name.log" 2>&1
    echo "== $name: exit $? $(tail -n 2 "$ROOT/$name.log" | tr '\n' ' ')"
}
one grpo train.save_interval=0
one ppo algo.name=ppo critic.lr=1.0e-5 train.save_interval=-1
python3 -m mtrain.converters mcore-to-hf --mcore "$ROOT/grpo/checkpoints/$(cat "$ROOT/grpo/checkpoints/latest")/mcore" \
    --out "$ROOT/teacher_hf" --hf-config "$HF_DIR" --force > "$ROOT/teacher.log" 2>&1 \
    && echo "== teacher: $ROOT/teacher_hf" || echo "== teacher: export failed (see $ROOT/teacher.log)"
[ -f "$ROOT/teacher_hf/config.json" ] && one distill "algo.distill.teacher_path=$ROOT/teacher_hf" train.save_interval=-1
python3 - "$ROOT" <<'PY'
import json, pathlib, statistics, sys
for name in ("grpo", "ppo", "distill"):
    f = pathlib.Path(sys.argv[1]) / name / "metrics.jsonl"
    if not f.exists():
        print(name, "no metrics"); continue
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    ev = [(r["step"], round(r["eval/reward_mean"], 3)) for r in recs if "eval/reward_mean" in r]
    tr = [r for r in recs if "weight_version" in r]
    split = {k: round(statistics.median(r.get(f"time/{k}", 0.0) for r in tr), 3)
             for k in ("rollout", "logprobs", "train", "sync")} if tr else {}
    extra = {k: [round(r[k], 4) for r in tr if k in r][::7] for k in
             ("critic/value_loss", "critic/explained_var", "distill/reverse_kl") if any(k in r for r in tr)}
    print(name, "eval", ev, "median step split s", split, extra)
PY
tar --exclude='checkpoints' --exclude='teacher_hf' -czf "$OUT/ppo_distill_runs.tgz" -C /tmp ppo_distill_runs
