#!/usr/bin/env bash
# GRPO on same-denominator fraction sums (LaTeX answers in \boxed{}, math-verify reward) with SmolLM2-135M-Instruct.
#   bash examples/math_fractions/run.sh [extra a.b.c=value overrides]
#   env: RECIPE=cpu|gpu, NPROC, RUN_DIR, HF_DIR, DATA_DIR, N_TEST
# RECIPE=cpu (default): the reference engine, one rank, a `datasets` save_to_disk folder (needs the extras:
# pip install -e '.[math,datasets]'). RECIPE=gpu: SGLang with examples/smollm2/gpu.overrides (the same model, the same
# reasons: docs/design-gpu-recipe.md), the data as jsonl (no `datasets` needed; math-verify is), and more problems per
# step (examples/math_fractions/gpu.overrides). Prints the eval and train reward means per step at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
RECIPE=${RECIPE:-cpu}
NPROC=${NPROC:-1}
RUN_DIR=${RUN_DIR:-runs/math_fractions}
DATA_DIR=${DATA_DIR:-$RUN_DIR/data}
HF_DIR=${HF_DIR:-$("$PY" -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
RECIPE_ARGS=()
case "$RECIPE" in
    cpu) FORMAT=datasets; DATA_ARGS=("data.train_path=$DATA_DIR" "data.eval_path=$DATA_DIR") ;;
    gpu) FORMAT=jsonl; DATA_ARGS=("data.train_path=$DATA_DIR/train.jsonl" "data.eval_path=$DATA_DIR/test.jsonl")
         mapfile -t RECIPE_ARGS < <(grep -hv '^[[:space:]]*\(#\|$\)' examples/smollm2/gpu.overrides \
                                    examples/math_fractions/gpu.overrides) ;;
    *) echo "run.sh: error: RECIPE=$RECIPE: use cpu or gpu" >&2; exit 2 ;;
esac
[ -e "$DATA_DIR" ] || "$PY" examples/math_fractions/make_data.py "$DATA_DIR" --test "${N_TEST:-48}" --format "$FORMAT"
CMD=("$PY" -m torch.distributed.run --nproc-per-node "$NPROC" -m mtrain train examples/math_fractions/grpo_fractions.yaml
     "${RECIPE_ARGS[@]}" "model.hf_path=$HF_DIR" "train.run_dir=$RUN_DIR" "${DATA_ARGS[@]}" "$@")
echo "recipe: $RECIPE"; echo "${CMD[*]}"
"${CMD[@]}"
"$PY" - "$RUN_DIR" <<'PY'
import json, sys
from mtrain.metrics import read_metrics
recs = read_metrics(sys.argv[1])
evals = [(r["step"], r["eval/reward_mean"]) for r in recs if "eval/reward_mean" in r]
train = [(r["step"], round(r["reward/mean"], 4)) for r in recs if "reward/mean" in r]
print(json.dumps({"eval_reward_mean": evals, "train_reward_mean": train}))
PY
