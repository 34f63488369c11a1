#!/usr/bin/env bash
# Tiny DeepSeek-V3 GRPO on CPU: EP2 on 2 ranks, then TP2 x EP2 on 4 ranks (data parallel 2 for dense weights).
# Run from the repository root after `pip install -e ".[cpu,test]"`. About 1-3 minutes each on 2 cores.
set -euo pipefail
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
cfg=examples/deepseek_v3/tiny/grpo.yaml
[ -f runs/deepseek_v3_tiny/hf/config.json ] || mtrain init-tiny --arch deepseek_v3 --out runs/deepseek_v3_tiny/hf
torchrun --nproc-per-node 2 -m mtrain train $cfg parallel.ep=2 train.run_dir=runs/deepseek_v3_tiny/ep2 "$@"
torchrun --nproc-per-node 4 -m mtrain train $cfg parallel.tp=2 parallel.ep=2 train.run_dir=runs/deepseek_v3_tiny/tp2ep2 "$@"
mtrain plot runs/deepseek_v3_tiny/ep2
