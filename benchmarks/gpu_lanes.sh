#!/usr/bin/env bash
# Runs named parts of the GPU round scripts in parallel lanes (each lane on its own GPUs, its parts one after the
# other) under one deadline, then packs every log and result into $OUT/results.tgz: the device tool brings back at
# most 8 files, and a call cut at its limit brings back nothing of its stdout. From the repository root, `.gpu/`
# carried:
#   LANES="0:tool,front,pack 1:partial,partial_learn" DEADLINE=540 bash benchmarks/gpu_lanes.sh
#   LANES="0,1:dsv3" DSV3_ARGS="train.collective_timeout_s=120" bash benchmarks/gpu_lanes.sh
# Parts: those of benchmarks/gpu_round3.sh (dsv3 timeout pack front tool fp8 fp8_llama8b fp8_qwen3moe fp8_decode kernel5
# routing_dsv3 routing_qwen3moe routing_start vlm_mt pack_rope_loop), of benchmarks/gpu_round2.sh (partial partial_learn fp8loop fp8tis), moe_spread, fp8_sweep and fp8_exact (benchmarks/gpu_moe_spread.sh, gpu_fp8_sweep.sh, gpu_fp8_exact.sh), and vlm (benchmarks/gpu_vlm.py;
# needs .gpu-extra/, BUILD.md "GPU"). A part that would start with under 90 s left is skipped and says so.
# Lanes share the CPU cores and the host: a timing taken beside another lane says so in docs/results.md.
set -uo pipefail
repo=$(pwd)
out=${OUT:-/tmp/mtrain-lanes}
deadline=${DEADLINE:-540}
t0=$(date +%s)
mkdir -p "$out"
source benchmarks/gpu_setup.sh || exit 1   # once, here: the lanes then find /tmp/site unpacked (its markers)
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader

elapsed() { echo $(( $(date +%s) - t0 )); }

run_part() {  # part dir: one part, its whole output in dir/part_<part>.txt
    local part=$1 dir=$2 left=$3
    case $part in
        partial|partial_learn|fp8loop|fp8tis)
            OUT=$dir PARTS=$part timeout -k 15 "$left" bash benchmarks/gpu_round2.sh ;;
        moe_spread|fp8_sweep|fp8_exact)  # issue 15: the MoE bucket's spread, the FP8 kernel's variants and exactness
            OUT=$dir/$part timeout -k 15 "$left" bash "benchmarks/gpu_${part}.sh" ;;
        vlm)
            (cd /tmp && OUT=$dir timeout -k 15 "$left" python "$repo/benchmarks/gpu_vlm.py" --out "$dir/vlm") ;;
        *)
            OUT=$dir PARTS=$part timeout -k 15 "$left" bash benchmarks/gpu_round3.sh ;;
    esac
}

lane() {  # devices parts(comma-separated)
    local devs=$1 parts=$2 part left rc name=lane${1//,/}
    local dir=$out/$name
    mkdir -p "$dir"
    for part in ${parts//,/ }; do
        left=$(( deadline - $(elapsed) ))
        if (( left < 90 )); then echo "$name: $part SKIPPED at +$(elapsed) s ($left s left)"; continue; fi
        echo "$name: $part starts at +$(elapsed) s on GPU $devs ($left s left)"
        CUDA_VISIBLE_DEVICES=$devs MTRAIN_PKG=/tmp/mtrain_pkg_$name run_part "$part" "$dir" "$left" \
            > "$dir/part_$part.txt" 2>&1
        rc=$?
        echo "$name: $part exit $rc at +$(elapsed) s"
        tail -n 25 "$dir/part_$part.txt"
        if [ "$part" = dsv3 ]; then  # the step's own copy is skipped when the deadline cut it
            cp /tmp/mtrain-dsv3-small/run/metrics.jsonl "$dir/dsv3_small_metrics.jsonl" 2>/dev/null
            cp /tmp/mtrain-dsv3-small/train.log "$dir/dsv3_train.log" 2>/dev/null
        fi
    done
}

pids=()
for spec in ${LANES:?set LANES, e.g. LANES=\"0:tool,front 1:partial\"}; do
    devs=${spec%%:*}
    lane "$devs" "${spec#*:}" > "$out/lane${devs//,/}.txt" 2>&1 &
    pids+=($!)
    sleep 5  # lanes start engines a little apart: their port probes do not race
done
wait "${pids[@]}"
for f in "$out"/lane*.txt; do echo "######## $(basename "$f")"; cat "$f"; done
tar -czf /tmp/results.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/results.tgz "$out/results.tgz"
ls -la "$out"
