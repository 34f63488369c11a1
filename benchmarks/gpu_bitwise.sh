#!/usr/bin/env bash
# numerics.on_policy=bitwise with SGLang on one GPU: the kernels' checks (gpu_bitwise_check.py), then GRPO runs with
# the engine in process, bitwise and off one after the other on the same random model, for a SmolLM2-shaped Llama,
# a Qwen3-shaped model cut to 8 layers (qwen3), Qwen3-1.7B's shape
# (qwen3_1_7b) and a small Qwen3-MoE (qwen3moe). Each run's per-step logprob gap and phase times go to $OUT
# (summary: bitwise_runs.json).
# From the repository root on the GPU machine, after `source benchmarks/gpu_setup.sh`.
#   MODELS="smollm2 qwen3" MODES="bitwise off" STEPS=5 NEW=128 bash benchmarks/gpu_bitwise.sh
# EXTRA="key=value ..." adds overrides to every run (e.g. train.max_tokens_per_micro_batch=4096: packed micro-batches);
# KERNELS=0 skips the kernel checks, TILES=1 adds the linear tile candidates to them; PROFILE=1 also profiles the
# logprob pass off vs bitwise on the first model (gpu_bitwise_profile.py); ATTN=token runs the mode with
# bitwise_gpu.paged_attention on both sides (MTRAIN_BITWISE_ATTENTION) instead of segment_attention, the default;
# ELEM=torch keeps RoPE and silu_mul in their torch forms (MTRAIN_BITWISE_ELEMENTWISE) instead of one launch each.
set -uo pipefail
repo=$(pwd)
work=${WORK:-/tmp/mtrain-bitwise}
out=${OUT:-$work}
mkdir -p "$work" "$out"
failed=0
[ -n "${ATTN:-}" ] && export MTRAIN_BITWISE_ATTENTION=$ATTN
[ -n "${ELEM:-}" ] && export MTRAIN_BITWISE_ELEMENTWISE=$ELEM
if [ "${KERNELS:-1}" = 1 ]; then
    python benchmarks/gpu_bitwise_check.py --out "$out/bitwise_kernels.json" ${TILES:+--tiles} > "$out/log_bitwise_kernels.txt" 2>&1 ||
        failed=$((failed + 1))
    tail -n 1 "$out/log_bitwise_kernels.txt"
fi
common="model.dtype=bfloat16 engine.kind=sglang engine.mem_fraction_static=0.3 train.steps=${STEPS:-5}
  rollout.prompts_per_step=16 rollout.samples_per_prompt=8 rollout.max_new_tokens=${NEW:-128} rollout.max_prompt_len=128
  train.micro_batch_size=32 train.save_interval=-1 train.eval_interval=0 model.fp32_lm_head=false ${EXTRA:-}"
declare -A shape=(
  [smollm2]="--arch llama --set hidden_size=576 num_hidden_layers=30 num_attention_heads=9 num_key_value_heads=3
             head_dim=64 intermediate_size=1536 vocab_size=49152 rope_theta=100000 tie_word_embeddings=true
             max_position_embeddings=8192"
  [qwen3]="--arch qwen3 --set hidden_size=1024 num_hidden_layers=8 num_attention_heads=16 num_key_value_heads=8
           head_dim=128 intermediate_size=3072 vocab_size=151936 max_position_embeddings=8192"
  [qwen3_1_7b]="--arch qwen3 --set hidden_size=2048 num_hidden_layers=28 num_attention_heads=16 num_key_value_heads=8
               head_dim=128 intermediate_size=6144 vocab_size=151936 tie_word_embeddings=true
               max_position_embeddings=8192"
  [qwen3moe]="--arch qwen3_moe --set hidden_size=1024 num_hidden_layers=4 num_attention_heads=16 num_key_value_heads=4
              head_dim=128 moe_intermediate_size=384 num_experts=32 num_experts_per_tok=8 vocab_size=151936
              max_position_embeddings=8192"
)
failed_runs=()  # named at the end: a run that died has no gap to report, which is not a gap of 0
for model in ${MODELS:-smollm2 qwen3}; do
    hf=$work/$model/hf
    [ -f "$hf/config.json" ] || (cd "$work" && python -m mtrain init-tiny --out "$hf" ${shape[$model]} > /dev/null) ||
        { echo "== $model: init-tiny failed"; failed=$((failed + 1)); continue; }
    for mode in ${MODES:-bitwise off}; do
        name=${model}_$mode
        rm -rf "$work/$name"
        (cd "$work" && timeout ${RUN_LIMIT:-240} torchrun --nproc-per-node 1 -m mtrain train \
            "$repo/mtrain/configs/tiny_llama_grpo.yaml" model.hf_path="$hf" train.run_dir="$work/$name" $common \
            numerics.on_policy=$mode > "$out/log_$name.txt" 2>&1)
        rc=$?
        echo "== $name: exit $rc"
        [ $rc -eq 0 ] || { failed=$((failed + 1)); failed_runs+=("$name"); grep -v -i warn "$out/log_$name.txt" | grep -B 20 -A 3 "Error" | head -n 50; }
        cp "$work/$name/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
    done
done
if [ "${PROFILE:-0}" = 1 ]; then
    first=$(echo ${MODELS:-smollm2} | awk '{print $1}')
    python benchmarks/gpu_bitwise_profile.py --hf "$work/$first/hf" --out "$out/bitwise_profile.json" \
        > "$out/log_bitwise_profile.txt" 2>&1 || failed=$((failed + 1))
    tail -n 1 "$out/log_bitwise_profile.txt"
fi
python - "$out" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1]); res = {}
for f in sorted(out.glob("metrics_*.jsonl")):
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    steps = [r for r in recs if "logprob_diff/max_abs" in r]
    later = steps[1:] or steps  # step 1 compiles the kernels
    med = lambda k: statistics.median([r[k] for r in later if k in r]) if any(k in r for r in later) else None  # noqa: E731
    res[f.stem[len("metrics_"):]] = {
        "max_abs_per_step": [r["logprob_diff/max_abs"] for r in steps],
        "mean_abs_per_step": [r["logprob_diff/mean_abs"] for r in steps],
        **{k: med(k) for k in ("time/step", "time/rollout", "time/logprobs", "time/train", "time/sync")},
        "time/step_all": [r.get("time/step") for r in later]}
for m in {k.rsplit("_", 1)[0] for k in res}:
    b, o = res.get(f"{m}_bitwise"), res.get(f"{m}_off")
    if b and o and b["time/step"] and o["time/step"]:
        res[f"{m}_ratio"] = {k: (b[k] / o[k] if b[k] and o[k] else None)
                             for k in ("time/step", "time/rollout", "time/logprobs", "time/train")}
print(json.dumps(res, indent=1))
(out / "bitwise_runs.json").write_text(json.dumps(res, indent=1))
bad = [k for k, v in res.items() if k.endswith("_bitwise") and any(x != 0.0 for x in v["max_abs_per_step"])]
print("finished bitwise runs with a nonzero gap:", bad or "none")
sys.exit(1 if bad else 0)
PY
[ $? -eq 0 ] || failed=$((failed + 1))
[ ${#failed_runs[@]} -eq 0 ] || echo "runs that failed: ${failed_runs[*]}"
[ "$failed" -eq 0 ]
