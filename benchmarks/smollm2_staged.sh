# Sourced by the SmolLM2 GPU scripts (gpu_smollm2.sh, gpu_ppo_distill.sh) with their action in $1: set up the GPU
# machine, take the GGUF halves carried in this call (benchmarks/stage_smollm2.py), and for every action but `stage`
# convert the GGUF and set HF_DIR; it exits the calling script after `stage` or when the model is not in place.
me=$(basename "$0")
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/stage_smollm2.py take; rc=$?
[ "${1:-}" = stage ] && exit 0
[ $rc -ne 0 ] && { echo "$me: the GGUF is not in place (stage_smollm2.py exit $rc)" >&2; exit 1; }
HF_DIR=$(python3 -c "from mtrain.converters.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())" 2>/dev/null | tail -n 1)
[ -f "$HF_DIR/config.json" ] || { echo "$me: conversion failed" >&2; exit 1; }
