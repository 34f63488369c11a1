#!/usr/bin/env bash
# Engine-pool runs on nvidia-h200-x2 (issue 10): from the repo root on the GPU machine, results into $OUT.
#   (a) GRPO, the same config: one GPU with one TP1 engine vs two GPUs with two TP1 engines (DP2 training):
#       rollout tokens/s, logprob gap, groups per engine;
#   (a') GRPO at training TP2 with ONE TP2 engine synced in pull mode with owners spread (the loop's own path);
#   (b) bench_sync_tp2.py: Llama-8B shape, training TP2 -> one SGLang TP2 engine: pull vs push vs HF-names.
# PARTS="a b" picks parts (default both).
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-pool-runs}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
export NCCL_NVLS_ENABLE=0
parts=" ${PARTS:-a b} "
failed=0
work=/tmp/mtrain-pool
rm -rf "$work" && mkdir -p "$work"
# A rollout heavy enough to measure: 32 prompts x 8 samples, up to 128 new tokens; a tiny Llama with a large vocab so
# that random EOS is rare and lengths vary.
common="model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.3 train.steps=${STEPS:-4}
  rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=128 train.micro_batch_size=32
  train.save_interval=-1 train.eval_interval=0 reward.fn=$repo/tests/trainer/signal_reward.py:digit_share
  model.hf_path=$work/hf"
loop() {  # name nproc extra...
    local name=$1 nproc=$2; shift 2
    (cd "$work" && timeout 400 torchrun --nproc-per-node "$nproc" -m mtrain train \
        "$repo/mtrain/configs/tiny_llama_grpo.yaml" train.run_dir="$work/$name" $common "$@" > "$out/log_$name.txt" 2>&1)
    local rc=$?
    echo "== $name: exit $rc"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    grep -v -i "warn" "$out/log_$name.txt" | grep -B 12 -A 3 "Error" | head -n 40
    cp "$work/$name/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
    python3 - "$out/metrics_$name.jsonl" <<'EOF'
import json, statistics, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except FileNotFoundError:
    sys.exit(0)
recs = [r for r in recs if "perf/rollout_tokens_per_s" in r][1:]  # step 1 carries Triton JIT
if recs:
    tps = [r["perf/rollout_tokens_per_s"] for r in recs]
    print(f"   rollout tokens/s median {statistics.median(tps):.0f} (min {min(tps):.0f}, max {max(tps):.0f}, "
          f"{len(tps)} steps); engines {recs[-1]['rollout/engines']:.0f}, groups/engine "
          f"{recs[-1]['rollout/groups_per_engine_min']:.0f}-{recs[-1]['rollout/groups_per_engine_max']:.0f}; "
          f"logprob gap mean {statistics.mean(r['logprob_diff/mean_abs'] for r in recs):.4f}; "
          f"sync {statistics.median(r['time/sync'] for r in recs) * 1e3:.1f} ms")
EOF
}
if [[ $parts == *" a "* ]]; then
    (cd "$work" && python -m mtrain init-tiny --out "$work/hf" --arch llama --set hidden_size=512 head_dim=64 \
        num_attention_heads=8 num_key_value_heads=2 intermediate_size=1024 vocab_size=4096 >/dev/null)
    loop one_engine 1
    loop two_engines 2 parallel.tp=1 engine.tp=1
    loop tp2_engine_pull 2 parallel.tp=2 engine.tp=2 sync.mode=pull
fi
if [[ $parts == *" b "* ]]; then
    timeout 500 torchrun --nproc-per-node 2 benchmarks/bench_sync_tp2.py --model llama8b > "$out/log_bench_sync_tp2.txt" 2>&1
    rc=$?
    echo "== bench_sync_tp2: exit $rc"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    grep -v -i warn "$out/log_bench_sync_tp2.txt" | tail -n 30
fi
[ "$failed" -eq 0 ]  # every run and the sync benchmark exited 0
