#!/usr/bin/env bash
# The DeepSeek-V3 recipe at reduced size on one CPU box, every step the 671B run needs, in order:
#   1. the model's config.json (the release's, sizes changed: mtrain.tiny_configs "deepseek_v3_small")
#   2. an FP8 release checkpoint (block-scaled float8_e4m3fn + weight_scale_inv, MTP layer included)
#   3. hf-to-mcore at the training layout: PP2 with the uneven split 3 | 4, EP2 (4 ranks), FP8 dequantised on the way
#   4. training: torchrun 4 ranks, DAPO, uneven PP + EP + distributed optimizer + full recompute, MTP off
#   5. export of the trained checkpoint to HF (transformers loads it) and verify: Megatron's logits at the
#      training layout against transformers' on the export
#   6. memory: memory_math.py's prediction for this size beside what step 4 measured
# From the repository root after `pip install -e ".[cpu,test]"`; WORK (default runs/dsv3_small) holds everything.
set -euo pipefail
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 TOKENIZERS_PARALLELISM=false
here=examples/deepseek_v3/small
work=${WORK:-runs/dsv3_small}
mkdir -p "$work"
python -c "import json, sys; from mtrain.tiny_configs import tiny_config; json.dump(tiny_config('deepseek_v3_small'), sys.stdout, indent=1)" > "$work/config.json"
[ -f "$work/release/config.json" ] || mtrain-convert make-fp8 --config "$work/config.json" --out "$work/release" --seed 0
[ -f "$work/mcore-pp2ep2/metadata.json" ] || mtrain-convert hf-to-mcore --hf "$work/release" --out "$work/mcore-pp2ep2" \
    --tp 1 --pp 2 --ep 2 --first-stage-layers 3 --last-stage-layers 4 --dtype float32
torchrun --standalone --nproc-per-node 4 -m mtrain train $here/config.yaml model.hf_path="$work/release" \
    model.mcore_ckpt="$work/mcore-pp2ep2" train.run_dir="$work/run" "$@"
step=$(ls -d "$work"/run/checkpoints/step_* | sort -t_ -k2 -n | tail -1)
mtrain-convert mcore-to-hf --mcore "$step/mcore" --hf-config "$work/release" --out "$work/export" --force
mtrain-convert verify --hf "$work/export" --mcore "$step/mcore" --pp 2 --ep 2 --first-stage-layers 3 --last-stage-layers 4
python examples/deepseek_v3/full/memory_math.py --config "$work/config.json" --nodes 1 --gpus-per-node 4 --pp 2 --ep 2 \
    --first-stage-layers 3 --last-stage-layers 4 --dtype fp32 --seq 80 --measured "$work/run/metrics.jsonl"
