#!/usr/bin/env bash
# The GPU benchmarks and checks of benchmarks/README.md by name, one after the other, each under its own time limit.
# From the repository root on the GPU machine (.gpu/ carried or already unpacked, see gpu_setup.sh):
#   bash benchmarks/run_gpu.sh list                      # the names, their GPUs and limits
#   OUT=/tmp/out bash benchmarks/run_gpu.sh sync kernel front
#   PACK=1 bash benchmarks/run_gpu.sh ...                # also pack $OUT into $OUT/results.tgz (one file to bring back)
# Each benchmark's whole log goes to $OUT/log_NAME.txt and its JSON (where it writes one) under $OUT; its exit code,
# wall time and the log's tail are printed here. REPEATS (default 3) is the number of separate processes for the
# kernel benchmarks: their figures moved with the allocation pattern of a process, so one process is no spread.
# While a benchmark runs, a line at least every 30 s: its elapsed seconds and its log's last line (`heartbeat`).
# Sourced (`source benchmarks/run_gpu.sh`), it only defines its functions (tests/benchmarks/ call them on a CPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
out=${OUT:-/tmp/mtrain-bench}
repeats=${REPEATS:-3}

# name|GPUs|limit s|what (the command is in run_one below)
CATALOG="
sync|1|420|full-model weight sync, mtrain push vs SGLang's HF-names path (Llama-8B shape)
sync_tp2|2|420|sync into one TP2 engine from TP2 training: pull vs push vs HF-names
reshard_nccl|2|300|resharding over NCCL, push and pull, against SGLang's own slicing
kernel|1|600|resharding kernel vs plain copy on dense/MoE buckets, REPEATS processes
fp8_kernel|1|600|block-FP8 scatter vs bf16 scatter vs copy (Qwen3-MoE x REPEATS processes, Llama-8B once)
fp8_sync|1|420|FP8 sync bit-equal to SGLang's own FP8 load, and its time vs bf16 (tiny DeepSeek-V3)
fp8_sync_llama8b|1|420|the same on the Llama-8B shape
fp8_sync_qwen3moe|1|420|the same on Qwen3-30B-A3B's layer shape
fp8_sync_channel|1|300|per-channel FP8 sync kernel bit-equal to SGLang's own online quantization (SmolLM2 shapes)
fp8_decode|1|300|rollout tokens/s, FP8 engine vs bf16 engine
fp8_loop|1|300|GRPO with an FP8 engine (tiny DeepSeek-V3)
rl_loop|1|400|GRPO with SGLang colocated, tiny Llama and tiny DeepSeek-V3
train|1|400|trainer step tokens/s: padded vs packed vs fixed-length ceiling (Llama-3.2-1B shape)
packed_attn|1|240|packed attention forward+backward, old per-sequence path vs varlen
front|1|300|OpenAI front under 64 clients vs direct engine calls
tool|1|300|multi-turn calculator rollouts on SGLang, token-in-token-out checked
partial|1|330|synchronous vs partial rollout on the longtail task: trained tokens/s
partial_learn|1|300|both rollout modes' reward curves, 12 steps
async|1|590|colocated rollout.async=one_step vs synchronous on the SmolLM2 demo (model staged: gpu_smollm2.sh stage)
routing_dsv3|1|420|routing replay off vs on: logprob gap, disagreement, overhead (tiny DeepSeek-V3)
routing_qwen3moe|1|420|the same on a Qwen3-MoE-shaped model
routing_start|1|300|routed_experts_start_len rows equal the start-0 rows; multi-turn bytes
timeout|2|240|a stalled and a dead rank end the job within train.collective_timeout_s
dsv3_small|2|540|the DeepSeek-V3 recipe at reduced size: PP2 training, one TP2xEP2 engine
pool|2|600|engine pool: one GPU/one engine vs two GPUs/two engines; TP2 pull sync
kernels_preflight|1|240|SGLang kernels no engine run reached yet, against float64
smoke|1|300|mtrain's SGLang engine against HF transformers
in_place_cache|1|300|after an update in place, a new request on a cached prompt gets the new weights (version-keyed prefix cache)
vlm|1|400|Qwen2.5-VL: sync bit-equal to a fresh load, then GRPO with images
vlm_rollout|1|300|image rollouts on SGLang against transformers
vlm_mt|1|300|multi-turn tool rollouts with an image on SGLang
lora_sync|1|420|LoRA sync into SGLang: full vs load_lora_adapter_from_tensors vs direct pool write (SmolLM2 staged)
lora_moe|1|300|expert LoRA on SGLang (tiny Qwen3-MoE): synced adapter generates as a fresh load
e2e_setup|1|300|write the e2e shapes' random bf16 weights (Qwen3-1.7B, Qwen3-4B) into /tmp (a warm machine keeps them)
e2e_1_7b|1|600|GRPO steps of a Qwen3-1.7B shape, 32 x 8 x 1,024 tokens, and every phase's floor in the same call
e2e_4b|1|600|the same on a Qwen3-4B shape (one H100: optim.cpu_offload, the fp32 main copy and Adam on the host, as the memory plan says); E2E_PART=run, then E2E_PART=floors in the next call: the two do not fit one
e2e_moe|1|600|the same on Qwen3-30B-A3B's layer shape cut to 5 layers (128 experts, 8 active), 16 x 8 x 512 tokens (offload and full recompute, as the memory plan says)
e2e_async_1_7b|1|600|rollout.async=off vs one_step on the Qwen3-1.7B shape (the same steps, one run per mode)
parity|1|400|mtrain's in-process engine vs a standalone sglang.Engine, 8 interleaved rounds (SmolLM2 staged)
parity_4b|1|420|the same on the Qwen3-4B shape (e2e_setup's random weights), 256 x 256 tokens
smollm2_learn|1|600|the SmolLM2 GPU recipe's runs side by side (gpu_smollm2.sh learn; SmolLM2 staged)
smollm2_onpolicy|1|600|SGLang's on-policy kernels (2 seeds), PPO, one_step beside the recipe (SmolLM2 staged)
smollm2_bitwise|1|600|the SmolLM2 GPU recipe with numerics.on_policy=bitwise, 3 seeds, beside the recipe (SmolLM2 staged)
smollm2_score_centering|1|600|the SmolLM2 GPU recipe on a per-channel FP8 engine, algo.score_centering off vs on, 3 seeds each (SmolLM2 staged)
bitwise|1|600|numerics.on_policy=bitwise with SGLang: kernels bit-equal, GRPO bitwise vs off (SmolLM2, Qwen3 shapes)
bitwise_token|1|600|the bitwise entry's runs with paged_attention (a program per token) on both sides (run it beside bitwise, one call)
bitwise_moe|1|420|the same, packed micro-batches, on a small Qwen3-MoE (routes equal without replay)
bitwise_1_7b|1|480|the same, packed micro-batches, on Qwen3-1.7B's shape
smollm2_probe|1|400|mtrain gap-probe with the GPU recipe (SmolLM2 staged)
smollm2_math|1|600|math_fractions with the math-verify reward, GPU recipe (SmolLM2 staged, .gpu-extra wheels)
smollm2_f32|1|600|a float32 trainer under the bf16 engine next to the bf16 recipe: logprob gap, step (SmolLM2 staged)
smollm2_lora|1|600|the LoRA demo with the GPU recipe: adapter sync time, gap, step (SmolLM2 staged)
ppo_distill|1|600|PPO and on-policy distillation on the SmolLM2 demo (gpu_ppo_distill.sh run; SmolLM2 staged)
separate|2|600|separate placement over NCCL: shard-to-shard sync, one_step on 2 GPUs vs colocated sync on 1
shared_prefix|1|300|train.shared_prefix vs whole rows: forward+backward step, 2k-token prompts x 8 and a tool task (Qwen3-1.7B-sized Llama, bf16)
lora_loop|1|400|GRPO with LoRA, adapters synced into SGLang as policy-v{step} (tiny Llama)
"

heartbeat() {  # heartbeat NAME PID LOG [PERIOD]: returns once PID has ended; until then, every PERIOD s (default 25,
    # so that a line comes at least every 30 s whatever the machine's load), the elapsed seconds and LOG's last line
    # that is not a warning: a benchmark that went quiet is told from one that hangs without opening its log.
    local name=$1 pid=$2 log=$3 period=${4:-25} t0=$SECONDS
    local next=$((t0 + period))
    while kill -0 "$pid" 2>/dev/null; do
        sleep 0.5
        if [ "$SECONDS" -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
            echo "   $name $((SECONDS - t0)) s: $(grep -v -i warn "$log" 2>/dev/null | tail -n 1 | cut -c 1-200)"
            next=$((next + period))
        fi
    done
}

list() { echo "$CATALOG" | awk -F'|' 'NF==4 {printf "%-18s %s GPU  %4s s  %s\n", $1, $2, $3, $4}'; }

tiny_longtail_llama() {  # the longtail benchmarks' model: a tiny Llama with a vocabulary large enough to rarely stop
    [ -f /tmp/mtrain-partial-hf/config.json ] || (cd /tmp && python -m mtrain init-tiny --out /tmp/mtrain-partial-hf \
        --arch llama --set hidden_size=512 head_dim=64 num_attention_heads=8 num_key_value_heads=2 \
        intermediate_size=1024 vocab_size=4096 max_position_embeddings=2048 >/dev/null)
}

run_one() {  # name: the command of one benchmark (run from /tmp where it starts mtrain as a user would)
    local longtail="--prompts 32 --samples 8 model.dtype=bfloat16 engine.kind=sglang train.micro_batch_size=32
        engine.mem_fraction_static=0.3 rollout.max_new_tokens=1024 data.longtail.median_count=20"
    case $1 in
    sync) python benchmarks/bench_sync.py --model llama8b ;;
    sync_tp2) torchrun --standalone --nproc-per-node 2 benchmarks/bench_sync_tp2.py --model llama8b ;;
    reshard_nccl) torchrun --standalone --nproc-per-node 2 benchmarks/gpu_reshard_nccl.py ;;
    kernel) for i in $(seq "$repeats"); do  # separate processes: the spread is between processes
                mkdir -p "$out/kernel/run$i"
                OUT=$out/kernel/run$i python benchmarks/bench_kernel.py --gb 2 --no-sweep --scenarios dense,moe || return
            done ;;
    fp8_kernel) for i in $(seq "$repeats"); do
                    mkdir -p "$out/fp8_kernel/run$i"
                    OUT=$out/fp8_kernel/run$i python benchmarks/bench_fp8_kernel.py --model qwen3moe --layers 2 || return
                done
                OUT=$out/fp8_kernel python benchmarks/bench_fp8_kernel.py --model llama8b --layers 4 ;;
    fp8_sync) python benchmarks/gpu_fp8_sync.py --out "$out/fp8" --model dsv3tiny --disk --diag-rows 0 ;;
    fp8_sync_llama8b) python benchmarks/gpu_fp8_sync.py --out "$out/fp8" --model llama8b --contiguous-params ;;
    fp8_sync_qwen3moe) python benchmarks/gpu_fp8_sync.py --out "$out/fp8" --model qwen3moe12l --contiguous-params ;;
    fp8_sync_channel) python benchmarks/gpu_fp8_channel.py --out "$out/fp8_channel" ;;
    fp8_decode) python benchmarks/gpu_fp8_decode.py --out "$out/fp8_decode" --model "${FP8_DECODE_MODEL:-qwen3moe12l}" \
                    --fp8-backends "${FP8_DECODE_BACKENDS:-triton}" ${FP8_DECODE_GRAPHS:+--cuda-graphs} ;;
    fp8_loop) OUT=$out/fp8_loop STEPS=3 EXTRA="engine.weight_dtype=fp8" MODELS=dsv3 bash benchmarks/gpu_rl_loop.sh ;;
    rl_loop) OUT=$out/rl_loop bash benchmarks/gpu_rl_loop.sh ;;
    bitwise) OUT=$out/bitwise bash benchmarks/gpu_bitwise.sh ;;
    bitwise_token) OUT=$out/bitwise_token ATTN=token KERNELS=0 bash benchmarks/gpu_bitwise.sh ;;
    bitwise_moe) OUT=$out/bitwise_moe MODELS=qwen3moe STEPS=4 RUN_LIMIT=180 TILES=${TILES-1} \
                     EXTRA=train.max_tokens_per_micro_batch=4096 bash benchmarks/gpu_bitwise.sh ;;
    bitwise_1_7b) OUT=$out/bitwise_1_7b MODELS=qwen3_1_7b STEPS=4 RUN_LIMIT=210 KERNELS=0 \
                      EXTRA=train.max_tokens_per_micro_batch=4096 bash benchmarks/gpu_bitwise.sh ;;
    train) python benchmarks/bench_train_throughput.py --model 1b --samples 128 --max-len 2048 --mbs 2 --budget 4096 \
               --fixed-len 1024 --steps 3 --warmup 1 --out "$out/train_throughput_1b.json" ;;
    packed_attn) python benchmarks/bench_packed_attention.py --max-len 2048 --budget 4096 --samples 128 \
                     --out "$out/packed_attn.json" ;;
    front) (cd /tmp && python "$repo/benchmarks/bench_front.py" --engine sglang --clients 64 --duration 20 \
               --max-tokens 32 --out "$out/bench_front.json") ;;
    tool) (cd /tmp && python "$repo/benchmarks/gpu_tool_rollout.py" --engine sglang --out "$out/tool_rollout.json") ;;
    partial) tiny_longtail_llama && (cd /tmp && python "$repo/benchmarks/bench_partial_rollout.py" \
                 --hf /tmp/mtrain-partial-hf --repeats 3 --block 3 --over-sample 2,4 $longtail) ;;
    async) OUT="$out/async" REPEATS=1 STEPS=10 bash "$repo/benchmarks/gpu_async_one_step.sh" ;;
    partial_learn) tiny_longtail_llama && (cd /tmp && python "$repo/benchmarks/bench_partial_rollout.py" \
                       --hf /tmp/mtrain-partial-hf --json bench_partial_rollout_learn.json --repeats 0 --learn-steps 12 \
                       --over-sample 2 $longtail --learn-set optim.lr=3e-4 reward.fn=mtrain.data.rewards:digit_share_reward) ;;
    routing_dsv3|routing_qwen3moe) python benchmarks/gpu_routing_replay.py --models "${1#routing_}" \
                                       --out "$out/routing_replay_${1#routing_}.json" ;;
    routing_start) python benchmarks/gpu_routing_start_len.py --out "$out/routing_start_len.json" ;;
    timeout) local fault  # each job must fail (non-zero) within ~20 s + NCCL's teardown, never hang to the limit
             for fault in hang die; do
                 local t0=$SECONDS rc
                 timeout 110 torchrun --standalone --nproc-per-node 2 benchmarks/collective_timeout.py --fault $fault \
                     --timeout-s 20; rc=$?
                 echo "timeout $fault: exit $rc after $((SECONDS - t0)) s"
                 if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then return 1; fi  # 0: nothing failed; 124: it hung 110 s
             done ;;
    dsv3_small) rm -rf /tmp/mtrain-dsv3-small
                # a train.log that stops growing gets its processes' stacks in $out/dsv3_stacks.txt
                HANG_DUMP_IDLE=${DSV3_DUMP_IDLE:-100} bash benchmarks/hang_dump.sh /tmp/mtrain-dsv3-small/train.log \
                    "$out/dsv3_stacks.txt" $$ > "$out/log_dsv3_hang_dump.txt" 2>&1 &
                local dump=$!
                bash examples/deepseek_v3/small/run_gpu.sh ${DSV3_ARGS:-}; local rc=$?
                kill "$dump" 2>/dev/null; wait "$dump" 2>/dev/null
                cp /tmp/mtrain-dsv3-small/run/metrics.jsonl "$out/dsv3_small_metrics.jsonl" 2>/dev/null
                return $rc ;;
    pool) OUT=$out/pool bash benchmarks/gpu_pool_runs.sh ;;
    kernels_preflight) python benchmarks/gpu_kernel_preflight.py --out "$out/kernel_preflight.json" ;;
    smoke) python benchmarks/gpu_sglang_smoke.py ;;
    in_place_cache) python benchmarks/gpu_in_place_cache.py ;;
    vlm) (cd /tmp && python "$repo/benchmarks/gpu_vlm.py" --out "$out/vlm") ;;
    vlm_rollout) (cd /tmp && python "$repo/benchmarks/gpu_vlm_rollout.py") ;;
    vlm_mt) (cd /tmp && python "$repo/benchmarks/gpu_vlm_multi_turn.py" --out "$out/vlm_multi_turn.json") ;;
    lora_sync) python benchmarks/gpu_lora_sync.py --model smollm2 --rank 32 --repeats 10 ;;
    lora_moe) python benchmarks/gpu_lora_moe.py && python benchmarks/gpu_lora_moe.py --targets experts ;;
    e2e_setup) local shape  # E2E_SHAPES: the shapes to write (default both dense ones; e2e_moe writes its own)
               for shape in ${E2E_SHAPES:-qwen3_1_7b qwen3_4b}; do
                   python benchmarks/gpu_e2e_step.py --model "$shape" --write-only || return
               done ;;
    e2e_1_7b) python benchmarks/gpu_e2e_step.py --model qwen3_1_7b --out "$out/e2e_1_7b.json" ;;
    # E2E_PART (all, run, floors): a shape's run and floors in two calls where one call's 10 minutes hold not both
    # Qwen3-4B on an H100: with Adam on the GPU (engine.offload_train, full recompute, micro-batches of 2,048) the
    # first optimizer step ran out of memory (2026-12-07); the memory plan now refuses that and passes this
    e2e_4b) python benchmarks/gpu_e2e_step.py --model qwen3_4b --part "${E2E_PART:-all}" \
                --out "$out/e2e_4b_${E2E_PART:-all}.json" optim.cpu_offload=true ;;
    e2e_moe) python benchmarks/gpu_e2e_step.py --model qwen3_30b_a3b_5l --prompts 16 --new-tokens 512 \
                 --part "${E2E_PART:-all}" --out "$out/e2e_moe_${E2E_PART:-all}.json" engine.offload_train=true \
                 train.recompute.granularity=full ;;
    # the engine at 0.3: resident while one_step trains, at 0.5 it ran out of memory (the memory plan refuses it)
    e2e_async_1_7b) python benchmarks/gpu_e2e_step.py --model qwen3_1_7b --async-modes off,one_step --no-floors \
                        --mem-fraction 0.3 --out "$out/e2e_async_1_7b.json" ;;
    parity) bash benchmarks/gpu_smollm2.sh parity ;;
    parity_4b) python benchmarks/gpu_engine_parity.py --hf /tmp/e2e-qwen3_4b/hf --batches 256 --new 256 \
                   --out "$out/parity_4b.json" ;;
    smollm2_learn) bash benchmarks/gpu_smollm2.sh learn ;;
    smollm2_onpolicy) STAGGER=3 RUN_LIMIT=300 bash benchmarks/gpu_smollm2.sh learn recipe:train.seed=1234 \
                          fsdp1234:engine.server_args.rl_on_policy_target=fsdp,train.seed=1234 \
                          fsdp1235:engine.server_args.rl_on_policy_target=fsdp,train.seed=1235 \
                          ppo:algo.name=ppo,critic.lr=1e-5 one_step:rollout.async=one_step ;;
    smollm2_probe) bash benchmarks/gpu_smollm2.sh probe ;;
    # four runs on one GPU: each bitwise trainer is its own process with its own engine (0.12 of the GPU each),
    # started 15 s apart (3 s apart, an engine's start measured the memory another was still taking: "no GPU memory
    # for the KV cache", 2 of 4 runs on an H100)
    smollm2_bitwise) bw=numerics.on_policy=bitwise,model.fp32_lm_head=false
                     STAGGER=15 RUN_LIMIT=540 bash benchmarks/gpu_smollm2.sh learn recipe1234:train.seed=1234 \
                         bitwise1234:$bw,train.seed=1234 bitwise1235:$bw,train.seed=1235 bitwise1236:$bw,train.seed=1236 ;;
    # FP8 engines (SmolLM2: per-channel, engine.fp8_scaling=auto): score centering off vs on (its k:
    # algo.score_centering_k, default 128), seeds 1234-1236, in two batches of three started 15 s apart: one FP8
    # run holds ~16.6 GB of an H100 (engine at 0.1, trainer, CUDA context), so six at once run out of memory
    smollm2_score_centering) fp8=engine.weight_dtype=fp8,engine.mem_fraction_static=0.1
                     STAGGER=15 RUN_LIMIT=270 bash benchmarks/gpu_smollm2.sh learn off1234:$fp8,train.seed=1234 \
                         off1235:$fp8,train.seed=1235 off1236:$fp8,train.seed=1236 || return
                     STAGGER=15 RUN_LIMIT=270 bash benchmarks/gpu_smollm2.sh learn \
                         sc1234:$fp8,algo.score_centering=true,train.seed=1234 \
                         sc1235:$fp8,algo.score_centering=true,train.seed=1235 \
                         sc1236:$fp8,algo.score_centering=true,train.seed=1236 ;;
    smollm2_math) bash benchmarks/gpu_smollm2.sh math engine.mem_fraction_static=0.08 train.save_interval=-1 ;;
    smollm2_f32) bash benchmarks/gpu_smollm2.sh learn recipe:train.seed=1234,engine.mem_fraction_static=0.2 \
                     f32:model.dtype=float32,engine.weight_dtype=bfloat16,train.seed=1234,engine.mem_fraction_static=0.2 ;;
    smollm2_lora) bash benchmarks/gpu_smollm2.sh learn \
                      lora:@examples/smollm2/lora.overrides,train.save_interval=-1,engine.mem_fraction_static=0.2 ;;
    ppo_distill) bash benchmarks/gpu_ppo_distill.sh run ;;
    separate) OUT=$out/separate bash benchmarks/gpu_separate_two_gpu.sh ;;
    shared_prefix) python benchmarks/bench_shared_prefix.py --dtype bfloat16 --hidden 2048 --layers 28 --heads 16 \
                       --kv-heads 8 --ffn 6144 --vocab 151936 --budget 8192 --repeats 5 --json "$out/shared_prefix.json" ;;
    lora_loop) OUT=$out/lora_loop STEPS=3 MODELS=llama EXTRA="model.lora.targets=qkv,o_proj,gate_up,down
                   model.lora.rank=16 model.lora.alpha=32 model.lora.lr=1e-3" bash benchmarks/gpu_rl_loop.sh ;;
    *) echo "run_gpu.sh: no benchmark named '$1' (bash benchmarks/run_gpu.sh list)" >&2; return 2 ;;
    esac
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced: the functions only
if [ $# -eq 0 ] || [ "$1" = list ]; then list; exit 0; fi
if [ "$1" = --one ]; then run_one "$2"; exit; fi  # one benchmark, in the environment the loop below set up
for name in "$@"; do  # every name checked before anything starts
    echo "$CATALOG" | grep -q "^$name|" || { echo "run_gpu.sh: no benchmark named '$name'" >&2; list >&2; exit 2; }
done
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1
export OUT=$out NCCL_NVLS_ENABLE=0
failed=0
for name in "$@"; do
    limit=$(echo "$CATALOG" | awk -F'|' -v n="$name" '$1 == n {print $3}')
    t0=$(date +%s.%N)
    echo "== $name: started (limit $limit s, log $out/log_$name.txt)"
    timeout -k 15 "$limit" bash "$0" --one "$name" > "$out/log_$name.txt" 2>&1 &  # its own process group's limit
    pid=$!
    heartbeat "$name" "$pid" "$out/log_$name.txt"
    wait "$pid"
    rc=$?
    [ $rc -ne 0 ] && failed=$((failed + 1))
    echo "== $name: exit $rc$([ $rc = 124 ] && echo " (limit ${limit} s)"), wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
    grep -v -i "warn" "$out/log_$name.txt" | tail -n 14
done
if [ "${PACK:-0}" = 1 ]; then
    tar -czf /tmp/mtrain-results.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/mtrain-results.tgz "$out/results.tgz"
fi
exit $((failed > 0))
