#!/usr/bin/env bash
# GRPO on fraction arithmetic (LaTeX answers, math-verify reward, a HF dataset folder) with SmolLM2-135M-Instruct.
#   bash examples/math_fractions/run.sh [extra a.b.c=value overrides]   (env: NPROC, RUN_DIR, HF_DIR, DATA_DIR, N_TEST)
# CPU by default (one rank, reference engine); the GPU command is in README.md.
# Needs the extras: pip install -e '.[math,datasets]'
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=${NPROC:-1}
RUN_DIR=${RUN_DIR:-runs/math_fractions}
DATA_DIR=${DATA_DIR:-$RUN_DIR/data}
HF_DIR=${HF_DIR:-$(python -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
[ -d "$DATA_DIR" ] || python examples/math_fractions/make_data.py "$DATA_DIR" --test "${N_TEST:-48}"
CMD=(torchrun --nproc-per-node "$NPROC" -m mtrain train examples/math_fractions/grpo_fractions.yaml
     "model.hf_path=$HF_DIR" "train.run_dir=$RUN_DIR" "data.train_path=$DATA_DIR" "data.eval_path=$DATA_DIR" "$@")
echo "${CMD[*]}"
"${CMD[@]}"
python - "$RUN_DIR" <<'PY'
import json, sys
from mtrain.metrics import read_metrics
recs = read_metrics(sys.argv[1])
evals = [(r["step"], r["eval/reward_mean"]) for r in recs if "eval/reward_mean" in r]
train = [(r["step"], r["reward/mean"]) for r in recs if "reward/mean" in r]
print(json.dumps({"eval_reward_mean": evals, "train_reward_mean": train}))
PY
