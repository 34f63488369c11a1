#!/usr/bin/env bash
# The GRPO loop on one GPU with the real SGLang engine (colocated, direct weight sync every step), for a tiny
# random Llama and the tiny DeepSeek-V3 (examples/deepseek_v3/tiny/gpu_config.json). Run from the repo root
# on the GPU machine after `source benchmarks/gpu_setup.sh`; copies each run's metrics.jsonl to $OUT.
set -uo pipefail
work=${WORK:-/tmp/mtrain-gpu-rl}
rm -rf "$work" && mkdir -p "$work"
common="model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.25 train.steps=${STEPS:-4}
  rollout.prompts_per_step=8 rollout.samples_per_prompt=8 rollout.max_new_tokens=32 train.micro_batch_size=16
  train.save_interval=0 train.eval_interval=0 reward.fn=tests/trainer/signal_reward.py:digit_share"
run() {  # name, init-tiny args...
    local name=$1; shift
    python -m mtrain init-tiny --out "$work/$name/hf" "$@" >/dev/null || return 1
    torchrun --nproc-per-node 1 -m mtrain train mtrain/configs/tiny_llama_grpo.yaml model.hf_path="$work/$name/hf" \
        train.run_dir="$work/$name/run" $common > "${OUT:-$work}/log_$name.txt" 2>&1
    echo "== $name: exit $?"; grep -v -i "warn" "${OUT:-$work}/log_$name.txt" | grep -B 12 -A 3 "Error" | head -n 60
    cp "$work/$name/run/metrics.jsonl" "${OUT:-$work}/metrics_$name.jsonl" 2>/dev/null
}
run llama --arch llama --set hidden_size=256 head_dim=64 num_attention_heads=4 num_key_value_heads=2 \
    intermediate_size=512 vocab_size=128
run dsv3 --config examples/deepseek_v3/tiny/gpu_config.json
