#!/usr/bin/env bash
# The SmolLM2 runs on one GPU machine, from a plain checkout (BUILD.md, "GPU"). The GGUF arrives in two halves
# (benchmarks/stage_smollm2.py); each call first takes what it carries, so the call that brings the second half can
# already run. Usage (on the GPU machine, repository root):
#   bash benchmarks/gpu_smollm2.sh stage                   # set up + take the halves carried in this call
#   bash benchmarks/gpu_smollm2.sh learn [RUN ...]         # GPU-recipe runs side by side on the one GPU
#   bash benchmarks/gpu_smollm2.sh parity                  # benchmarks/gpu_engine_parity.py on the SmolLM2 weights
#   bash benchmarks/gpu_smollm2.sh math [override ...]     # examples/math_fractions RECIPE=gpu (math-verify reward;
#                                                          # its wheels in .gpu-extra/, BUILD.md "GPU"), 96 eval problems (384 train + 96 test stay below the ~505 distinct same-denominator sums)
#   bash benchmarks/gpu_smollm2.sh probe [RUN ...]         # `mtrain gap-probe` with the GPU recipe, one after another
# RUN = name:override,override,... (default: the recipe at three seeds, lr 5e-6, and the recipe without the fp32
# head); an item @FILE, at most one per run, is run.sh's OVERRIDES=FILE (lora:@examples/smollm2/lora.overrides:
# the LoRA demo).
# Results: $OUT/smollm2_runs.tgz (each run's metrics.jsonl, summary.json, log) and $OUT/*.log.
set -uo pipefail
source "$(dirname "$0")/smollm2_staged.sh" "${1:-}"  # set-up, the GGUF halves, HF_DIR
echo "HF_DIR=$HF_DIR"
case "$1" in
learn)
    shift
    runs=("$@")
    [ ${#runs[@]} -eq 0 ] && runs=(seed1234:train.seed=1234 seed1235:train.seed=1235 seed1236:train.seed=1236
                                    lr5e-6:optim.lr=5.0e-6 nofp32head:model.fp32_lm_head=false)
    for run in "${runs[@]}"; do  # every run checked before any starts
        [ "$(grep -o '@' <<< "$run" | wc -l)" -le 1 ] || { echo "gpu_smollm2.sh: $run: one @FILE per run" >&2; exit 2; }
    done
    port=29600; pids=()
    for run in "${runs[@]}"; do
        # an item @FILE goes to run.sh as OVERRIDES=FILE (lists in it hold commas); run.sh reads its lines after the
        # recipe's and lets RUN_DIR win over a train.run_dir in it, so each run's folder is /tmp/smollm2_runs/NAME
        name=${run%%:*}; IFS=, read -r -a items <<< "${run#*:}"; over=(); file=""
        for o in "${items[@]}"; do
            if [[ $o == @* ]]; then file=${o#@}; else over+=("$o"); fi
        done
        dir=/tmp/smollm2_runs/$name; mkdir -p "$dir"
        # several runs share the GPU: a smaller engine each, distinct rendezvous ports
        OVERRIDES=$file PET_MASTER_PORT=$port RUN_DIR=$dir HF_DIR=$HF_DIR NPROC=1 timeout ${RUN_LIMIT:-540} \
            bash examples/smollm2/run.sh engine.mem_fraction_static=0.12 train.log_weight_change=true "${over[@]}" \
            > "$dir/log" 2>&1 &
        pids+=($!); port=$((port + 7)); sleep ${STAGGER:-15}
    done
    failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=$((failed + 1)); done
    for run in "${runs[@]}"; do name=${run%%:*}; echo "== $name: $(tail -n 3 /tmp/smollm2_runs/$name/log | tr '\n' ' ')"; done
    python3 - <<'PY'
import json, pathlib
for d in sorted(pathlib.Path("/tmp/smollm2_runs").iterdir()):
    f = d / "metrics.jsonl"
    if not f.exists():
        print(d.name, "no metrics"); continue
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    ev = [(r["step"], round(r["eval/reward_mean"], 3)) for r in recs if "eval/reward_mean" in r]
    tr = [r for r in recs if "logprob_diff/mean_abs" in r]
    gap = [r["logprob_diff/mean_abs"] for r in tr]; mx = [r["logprob_diff/max_abs"] for r in tr]
    w = [(r["step"], round(r.get("weights/changed_frac_total", -1), 3), round(r.get("weights/main_rel_change", -1), 5),
          round(r.get("weights/model_rel_change", -1), 5)) for r in tr if r["step"] in (1, 14, 28)]
    st = [r.get("time/step", sum(r.get(k, 0) for k in ("time/rollout", "time/logprobs", "time/train", "time/sync"))) for r in tr]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0  # noqa: E731
    sync = "sync MB median %.2f ms median %.1f" % (med([r.get("sync/bytes", 0) / 2**20 for r in tr]),
                                                   med([r.get("time/sync", 0) * 1e3 for r in tr]))
    mem = "grads+optim MB %.1f" % max([(r.get("mem/stage0/grads_bytes_max", 0) + r.get("mem/stage0/optim_bytes_max", 0))
                                       / 2**20 for r in tr] or [0])
    print(d.name, "eval", ev, "gap mean max %.4f mean %.4f" % (max(gap or [0]), sum(gap or [0]) / max(len(gap), 1)),
          "gap max max %.3f" % max(mx or [0]), "weights", w, "step_s median %.3f" % (sorted(st)[len(st) // 2] if st else 0), sync, mem)
PY
    tar --exclude='checkpoints' --exclude='step_*' --exclude='*.pt' -czf "$OUT/smollm2_runs.tgz" -C /tmp smollm2_runs
    echo "gpu_smollm2.sh learn: $failed of ${#runs[@]} run(s) failed"
    [ "$failed" -eq 0 ] ;;
math)
    shift
    dir=/tmp/math_fractions_gpu; rm -rf "$dir"; mkdir -p "$dir"
    RECIPE=gpu NPROC=1 N_TEST=96 RUN_DIR=$dir/run DATA_DIR=$dir/data HF_DIR=$HF_DIR timeout ${RUN_LIMIT:-540} \
        bash examples/math_fractions/run.sh "$@" > "$dir/log" 2>&1
    rc=$?
    echo "== math_fractions: exit $rc $(tail -n 1 "$dir/log")"
    python3 -m mtrain plot "$dir/run" --out "$dir/run/curves.png" > /dev/null 2>&1 || true
    tar --exclude='checkpoints' --exclude='data' -czf "$OUT/math_fractions_gpu.tgz" -C /tmp math_fractions_gpu
    [ "$rc" -eq 0 ] ;;
probe)
    shift
    runs=("$@")
    [ ${#runs[@]} -eq 0 ] && runs=(recipe: on_policy:engine.server_args.rl_on_policy_target=fsdp
                                    nofp32head:model.fp32_lm_head=false)
    mapfile -t recipe < <(grep -v '^[[:space:]]*\(#\|$\)' examples/smollm2/gpu.overrides)
    failed=0
    for run in "${runs[@]}"; do
        name=${run%%:*}; IFS=, read -r -a over <<< "${run#*:}"
        for rec in ${PROBE_RECORDS:-0}; do
            echo "== probe $name record $rec"
            timeout ${RUN_LIMIT:-300} python3 -m mtrain gap-probe examples/smollm2/grpo_addition.yaml "${recipe[@]}" \
                model.hf_path="$HF_DIR" engine.cuda_graphs=false "${over[@]}" --record "$rec" --new-tokens 64 --out "$OUT/probe_${name}_$rec.json" \
                > "$OUT/probe_${name}_$rec.log" 2>&1
            rc=$?; [ $rc -eq 0 ] || failed=$((failed + 1))
            echo "exit $rc"; grep -A 200 "^point" "$OUT/probe_${name}_$rec.log" | grep -v "^L[0-9]*\.norm"
        done
    done
    [ "$failed" -eq 0 ] ;;
parity)
    python3 benchmarks/gpu_engine_parity.py --hf "$HF_DIR" --out "$OUT/parity.json" 2>&1 | tee "$OUT/parity.log" | grep -v "^\["
    [ "${PIPESTATUS[0]}" -eq 0 ] ;;  # the benchmark's own exit, not grep's
*) echo "gpu_smollm2.sh: unknown action ${1:-}" >&2; exit 2 ;;
esac
