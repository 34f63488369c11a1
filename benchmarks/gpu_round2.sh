#!/usr/bin/env bash
# FP8 rollout (issue 15) and partial rollout (issue 11) on one H200; results into $OUT. From the repo root, `.gpu/`
# carried. PARTS picks: fp8 (sync vs bf16 + bit-equality, tiny DeepSeek-V3 and Llama-8B), fp8loop (GRPO with an FP8
# engine), fp8tis (the FP8 loop without and with algo.tis_cap=2.0; FP8TIS_MODELS, default dsv3; FP8TIS_TIMEOUT s per setting, default 300), partial (synchronous vs partial rollout on the longtail task: trained tokens/s with its spread and
# per-phase times, one job, about 3.5 min), partial_learn (both modes' reward curves over 12 steps, two runs from the
# same weights, about 4 min: a digit-share reward that a random model can climb, on the same heavy-tailed lengths).
set -uo pipefail
round=round2 default_parts="fp8 fp8loop partial"
source benchmarks/gpu_round_common.sh || exit 1
if [[ $parts == *" fp8 "* ]]; then
    step fp8_dsv3tiny 240 python benchmarks/gpu_fp8_sync.py --out "$out" --model dsv3tiny --disk --diag-rows 0
    step fp8_llama8b 420 python benchmarks/gpu_fp8_sync.py --out "$out" --model llama8b --contiguous-params
fi
if [[ $parts == *" fp8loop "* ]]; then
    (OUT=$out STEPS=3 EXTRA="engine.weight_dtype=fp8" MODELS=dsv3 timeout 200 bash benchmarks/gpu_rl_loop.sh \
        > "$out/log_fp8loop_wrapper.txt" 2>&1); echo "== fp8loop: exit $?"; tail -n 8 "$out/log_fp8loop_wrapper.txt"
fi
if [[ $parts == *" fp8tis "* ]]; then  # the FP8 loop after the KV-scale reset, without and with TIS (FP8TIS_MODELS="dsv3 llama")
    for tis in none 2.0; do
        extra="engine.weight_dtype=fp8"; [ "$tis" != none ] && extra="$extra algo.tis_cap=$tis"
        (OUT=$out/fp8tis_$tis STEPS=4 EXTRA="$extra" MODELS="${FP8TIS_MODELS:-dsv3}" WORK=/tmp/mtrain-gpu-rl-$tis \
            timeout "${FP8TIS_TIMEOUT:-300}" bash benchmarks/gpu_rl_loop.sh > "$out/log_fp8tis_$tis.txt" 2>&1)
        echo "== fp8tis $tis: exit $?"; tail -n 6 "$out/log_fp8tis_$tis.txt"
    done
fi
if [[ $parts == *" partial "* ]]; then
    # One job (about 3.5 min): interleaved blocks of 3 steps, synchronous vs partial at over_sample 2 and 4, 3 repeats.
    work=/tmp/mtrain-partial-hf && rm -rf "$work"
    (cd /tmp && python -m mtrain init-tiny --out "$work" --arch llama --set hidden_size=512 head_dim=64 \
        num_attention_heads=8 num_key_value_heads=2 intermediate_size=1024 vocab_size=4096 max_position_embeddings=2048 >/dev/null)
    (cd /tmp && step partial 330 python "$repo/benchmarks/bench_partial_rollout.py" --hf "$work" --repeats 3 --block 3 \
        --over-sample 2,4 --prompts 32 --samples 8 model.dtype=bfloat16 engine.kind=sglang train.micro_batch_size=32 \
        engine.mem_fraction_static=0.3 rollout.max_new_tokens=1024 data.longtail.median_count=20)
fi
if [[ $parts == *" partial_learn "* ]]; then
    work=/tmp/mtrain-partial-hf
    [ -f "$work/config.json" ] || (cd /tmp && python -m mtrain init-tiny --out "$work" --arch llama --set hidden_size=512 \
        head_dim=64 num_attention_heads=8 num_key_value_heads=2 intermediate_size=1024 vocab_size=4096 \
        max_position_embeddings=2048 >/dev/null)
    (cd /tmp && step partial_learn 300 python "$repo/benchmarks/bench_partial_rollout.py" --hf "$work" \
        --json bench_partial_rollout_learn.json --repeats 0 --learn-steps 12 --over-sample 2 --prompts 32 --samples 8 \
        model.dtype=bfloat16 engine.kind=sglang train.micro_batch_size=32 engine.mem_fraction_static=0.3 \
        rollout.max_new_tokens=1024 data.longtail.median_count=20 --learn-set optim.lr=3e-4 reward.fn=mtrain.data.rewards:digit_share_reward)
fi
