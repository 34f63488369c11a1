#!/usr/bin/env bash
# The GRPO loop on one GPU with the real SGLang engine (colocated, direct weight sync every step), for a tiny
# random Llama and the tiny DeepSeek-V3 (examples/deepseek_v3/tiny/gpu_config.json). Run from the repo root
# on the GPU machine after `source benchmarks/gpu_setup.sh`; writes each run's log and metrics.jsonl to $OUT.
# ENGINE=reference DTYPE=float32 runs the same plumbing on a CPU; SYNC_MODE=push|pull|auto picks the weight sync;
# NPROC=2 EXTRA="parallel.tp=2 engine.tp=2" MODELS=llama: two training ranks and a TP2 engine on two GPUs.
set -uo pipefail
repo=$(pwd)
work=${WORK:-/tmp/mtrain-gpu-rl}
out=${OUT:-$work}
rm -rf "$work" && mkdir -p "$work" "$out"
common="model.dtype=${DTYPE:-bfloat16} engine.kind=${ENGINE:-sglang} engine.mem_fraction_static=0.25
  train.steps=${STEPS:-4} rollout.prompts_per_step=8 rollout.samples_per_prompt=8 rollout.max_new_tokens=32
  train.micro_batch_size=16 train.save_interval=-1 train.eval_interval=0 sync.mode=${SYNC_MODE:-auto}
  reward.fn=$repo/tests/trainer/signal_reward.py:digit_share"
run() {  # name, init-tiny args...
    local name=$1; shift
    # Run from the work folder, as a user runs from a folder of their own (the checkout imports either way).
    (cd "$work" && python -m mtrain init-tiny --out "$work/$name/hf" "$@" >/dev/null &&
     torchrun --nproc-per-node "${NPROC:-1}" -m mtrain train "$repo/mtrain/configs/tiny_llama_grpo.yaml" \
        model.hf_path="$work/$name/hf" train.run_dir="$work/$name/run" $common ${EXTRA:-} > "$out/log_$name.txt" 2>&1)
    local rc=$?
    echo "== $name: exit $rc"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    grep -v -i "warn" "$out/log_$name.txt" | grep -B 12 -A 3 "Error" | head -n 60
    cp "$work/$name/run/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
}
failed=0
models=" ${MODELS:-llama dsv3} "
[[ $models == *" llama "* ]] && run llama --arch llama --set hidden_size=256 head_dim=64 num_attention_heads=4 num_key_value_heads=2 \
    intermediate_size=512 vocab_size=128
[[ $models == *" dsv3 "* ]] && run dsv3 --config "$repo/examples/deepseek_v3/tiny/gpu_config.json"
# exit 0 exactly when every run trained (not the status of the last `[[ ]]`: MODELS=llama ended in a false test, 1)
[ "$failed" -eq 0 ]
