# Sourced by benchmarks/gpu_round2.sh and gpu_round3.sh after they set `round` and `default_parts`: the output folder,
# SGLang/megatron-core made importable (gpu_setup.sh), the PARTS selection and `step`, which runs one part.
repo=$(pwd)
out=${OUT:-/tmp/mtrain-$round}
mkdir -p "$out"
source benchmarks/gpu_setup.sh || return 1
parts=" ${PARTS:-$default_parts} "
step() {  # name timeout cmd...: the command's whole log in $out, its tail here
    local name=$1 t=$2; shift 2
    local t0=$(date +%s.%N)
    (OUT=$out timeout "$t" "$@" > "$out/log_$name.txt" 2>&1)
    local rc=$?
    echo "== $name: exit $rc, wall $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
    grep -v -i "warn" "$out/log_$name.txt" | grep -v "steps:" | tail -n 14
}
