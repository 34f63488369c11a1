#!/usr/bin/env bash
# Tiny DeepSeek-V3 GRPO on CPU: EP2 on 2 ranks, then EP4 on 4 ranks (dense weights data-parallel over 4).
# TP x EP training needs sequence parallelism in megatron-core, which needs Transformer Engine or apex norms:
# on a CPU box MoE models train at TP1 (TP2 x EP2 forward and conversion are tested in tests/).
# Run from the repository root after `pip install -e ".[cpu,test]"`. About 1-3 minutes each on 2 cores.
set -euo pipefail
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
cfg=examples/deepseek_v3/tiny/grpo.yaml
[ -f runs/deepseek_v3_tiny/hf/config.json ] || mtrain init-tiny --arch deepseek_v3 --out runs/deepseek_v3_tiny/hf
torchrun --nproc-per-node 2 -m mtrain train $cfg parallel.ep=2 train.run_dir=runs/deepseek_v3_tiny/ep2 "$@"
torchrun --nproc-per-node 4 -m mtrain train $cfg parallel.ep=4 train.run_dir=runs/deepseek_v3_tiny/ep4 "$@"
mtrain plot runs/deepseek_v3_tiny/ep2
