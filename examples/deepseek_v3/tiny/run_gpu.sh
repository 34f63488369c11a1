#!/usr/bin/env bash
# Tiny DeepSeek-V3 GRPO on one GPU with the real SGLang engine (DeepseekV3ForCausalLM, triton MLA backend),
# colocated, weights synced through the direct path every step. The model uses DeepSeek-V3's per-head and
# per-expert shapes (gpu_config.json: SGLang's MLA kernels need them). On the GPU machine, from the repo root:
#   source benchmarks/gpu_setup.sh && bash examples/deepseek_v3/tiny/run_gpu.sh
set -euo pipefail
repo=$(pwd)
work=${WORK:-/tmp/mtrain-dsv3-tiny}
mkdir -p "$work" && cd "$work"   # outside the checkout: see BUILD.md, "GPU"
[ -f hf/config.json ] || python -m mtrain init-tiny --config "$repo/examples/deepseek_v3/tiny/gpu_config.json" --out hf
torchrun --nproc-per-node 1 -m mtrain train "$repo/examples/deepseek_v3/tiny/grpo.yaml" model.hf_path="$work/hf" \
    train.run_dir="$work/run" parallel.ep=1 model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.25 \
    rollout.prompts_per_step=8 rollout.samples_per_prompt=8 rollout.max_new_tokens=32 train.micro_batch_size=16 "$@"
