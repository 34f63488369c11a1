#!/usr/bin/env bash
# The DeepSeek-V3 recipe at reduced size on 2 x H200 (nvidia-h200-x2) with SGLang engines: run_cpu.sh's steps with
# the GPU model (mtrain.tiny_configs "deepseek_v3_small_gpu": the release's per-head and LoRA sizes, which SGLang's
# MLA kernels need; 7 layers = 3 dense + 4 MoE, 16 routed + 1 shared experts, one MTP layer, FP8 128x128), bf16.
# Training: PP2 with the uneven split 3 | 4 on the 2 GPUs (with TP1 and 2 GPUs EP must be 1: EP2 runs on the CPU),
# distributed optimizer with optimizer CPU offload, full recompute, MTP off; one SGLang engine TP2 x EP2 over both
# GPUs, colocated. On the GPU machine, from the repository root:
#   source benchmarks/gpu_setup.sh && bash examples/deepseek_v3/small/run_gpu.sh
# ENGINE_FP8=1: an FP8 engine (engine.weight_dtype=fp8: block-FP8 weights quantized by the sync, docs/fp8.md);
# without it the engine is bf16. Either way the engine's config.json is the dequantised export's (hf-bf16).
# GPUS=1: the same steps on one H200 (nvidia-h200) as a check of what the two-GPU kind cannot be lent for: PP1 (no
# uneven split, the CPU run and GPUS=2 cover it) and one engine TP1; everything else as above.
set -euo pipefail
repo=$(pwd)
gpus=${GPUS:-2}
case $gpus in
    2) split=(--pp 2 --first-stage-layers 3 --last-stage-layers 4); ckpt=mcore-pp2; over=(engine.tp=2 engine.ep=2) ;;
    1) split=(--pp 1); ckpt=mcore-pp1
       over=(parallel.pp=1 parallel.first_stage_layers=null parallel.last_stage_layers=null engine.tp=1 engine.ep=1) ;;
    *) echo "run_gpu.sh: GPUS must be 1 or 2, got $gpus" >&2; exit 2 ;;
esac
work=${WORK:-/tmp/mtrain-dsv3-small}
mkdir -p "$work" && cd "$work"   # outside the checkout: see BUILD.md, "GPU"
export OMP_NUM_THREADS=4 TORCHDYNAMO_DISABLE=1 TOKENIZERS_PARALLELISM=false
python -c "import json, sys; from mtrain.tiny_configs import tiny_config; json.dump(tiny_config('deepseek_v3_small_gpu'), sys.stdout, indent=1)" > config.json
[ -f release/config.json ] || python -m mtrain.converters make-fp8 --config config.json --out release --seed 0
[ -f $ckpt/metadata.json ] || torchrun --standalone --nproc-per-node "$gpus" -m mtrain.converters hf-to-mcore \
    --hf release --out $ckpt --tp 1 "${split[@]}" --dtype bfloat16
# the engine's config.json: the dequantised export's (an FP8 engine gets its quantization_config from the trainer)
[ -f hf-bf16/config.json ] || python -m mtrain.converters mcore-to-hf --mcore $ckpt --out hf-bf16
fp8=(); [ -n "${ENGINE_FP8:-}" ] && over+=(engine.weight_dtype=fp8) && fp8=(--engine-fp8)
torchrun --standalone --nproc-per-node "$gpus" -m mtrain train "$repo/examples/deepseek_v3/small/config.yaml" \
    model.hf_path="$work/hf-bf16" model.mcore_ckpt="$work/$ckpt" train.run_dir="$work/run" \
    model.dtype=bfloat16 parallel.ep=1 optim.cpu_offload=true engine.kind=sglang "${over[@]}" \
    engine.mem_fraction_static=0.3 rollout.prompts_per_step=8 rollout.samples_per_prompt=8 rollout.max_new_tokens=64 \
    train.global_batch_size=64 train.micro_batch_size=8 "$@" 2>&1 | tee "$work/train.log" || train_rc=$?
step=$(ls -d run/checkpoints/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
if (( ${train_rc:=0} )); then
    # The 2026-12-01 02:20 UTC run aborted in CUDA teardown after its last checkpoint (docs/archive/results-2026-11.md section 34), which
    # cost the export and verify steps. A checkpoint is renamed into place only when complete (COMPLETE marker), so
    # one of the last logged step can still be exported; the trainer's exit code stays this script's.
    last=$(python -c "from mtrain.metrics import read_metrics; print(max(r.get('step', -1) for r in read_metrics('run')))" \
        2>/dev/null || echo none)
    if [ -n "$step" ] && [ -f "$step/COMPLETE" ] && [ "${step##*_}" = "$last" ]; then
        echo "run_gpu.sh: the trainer exited $train_rc after the complete checkpoint of its last step ($step): exporting" \
            "it all the same; this script exits $train_rc at the end"
    else
        echo "run_gpu.sh: the trainer exited $train_rc without a complete checkpoint of its last step (${step:-none}," \
            "last logged step $last)"
        exit "$train_rc"
    fi
fi
python -m mtrain.converters mcore-to-hf --mcore "$step/mcore" --hf-config release --out export --force
# Megatron's forward in float32 (the bf16 weights upcast exactly) against transformers' float32: a bf16 forward
# flips top-k expert choices on this random MoE model and fails the bf16 tolerance with a correct checkpoint
# (docs/archive/results-2026-11.md, sections 13 and 40). A failure is reported, the memory step still runs, and the script fails.
python -m mtrain.converters verify --hf export --mcore "$step/mcore" "${split[@]}" --dtype float32 || verify_rc=$?
python "$repo/examples/deepseek_v3/full/memory_math.py" --config config.json --nodes 1 --gpus-per-node "$gpus" \
    "${split[@]}" --ep 1 --dtype bf16 --seq 512 --engine-tp "$gpus" --cpu-offload "${fp8[@]}" \
    --measured run/metrics.jsonl
(( train_rc )) && exit "$train_rc"
exit "${verify_rc:-0}"
