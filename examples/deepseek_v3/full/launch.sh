#!/usr/bin/env bash
# Start mtrain on THIS node; run it once on every node (slurm.sbatch does that with srun).
#   NNODES=64 MASTER=node0.example examples/deepseek_v3/full/launch.sh [a.b.c=value ...]
# Environment: NNODES (nodes in the job), MASTER (host of the first node: the c10d rendezvous runs there),
# optional CONFIG (default: config.yaml next to this script), RDZV_ID (same on every node; default
# mtrain-dsv3), RDZV_PORT (29500), NPROC_PER_NODE (8), DRY_RUN=1 (print the command instead of running it).
# Extra arguments are config overrides, e.g. train.steps=2 rollout.max_new_tokens=512.
set -euo pipefail
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER:?set MASTER to the hostname of the first node}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${CONFIG:-$here/config.yaml}"
[[ -f "$config" ]] || { echo "launch.sh: config file not found: $config" >&2; exit 2; }

# Megatron's comm/compute overlap needs one CUDA work queue; a few threads per rank for the host side.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

cmd=(torchrun
  --nnodes "$NNODES"
  --nproc-per-node "${NPROC_PER_NODE:-8}"
  --rdzv-backend c10d
  --rdzv-endpoint "$MASTER:${RDZV_PORT:-29500}"
  --rdzv-id "${RDZV_ID:-mtrain-dsv3}"
  -m mtrain train "$config" "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
