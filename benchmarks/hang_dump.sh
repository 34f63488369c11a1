#!/usr/bin/env bash
# Hang watchdog: once LOGFILE exists and has not grown for HANG_DUMP_IDLE s, write into OUTFILE what the run's
# processes are doing: the process tree (ps), nvidia-smi, every thread's Python stack of the processes that registered
# the SIGUSR1 dump (mtrain/debug_signals.py: `mtrain train` ranks, SGLang schedulers from their start),
# which they print into their stderr = LOGFILE, and `py-spy dump` of every Python process when py-spy is there.
#   bash benchmarks/hang_dump.sh LOGFILE OUTFILE [ROOT_PID] &
# ROOT_PID (default: the caller): only its descendants are looked at or signaled. Exits when ROOT_PID is gone, after
# HANG_DUMP_MAX dumps, or when killed. A dump makes the log grow (the stacks): the next needs another quiet spell.
# Env: HANG_DUMP_IDLE (100) HANG_DUMP_MAX (3) HANG_DUMP_POLL (5) HANG_DUMP_TAIL (600 log lines before the signal),
# HANG_DUMP_WAIT (5 s after the signal), HANG_DUMP_MATCH / HANG_DUMP_EXCLUDE (regexes on args: whom to signal).
set -uo pipefail
log=${1:?LOGFILE}; outf=${2:?OUTFILE}; root=${3:-$PPID}
idle=${HANG_DUMP_IDLE:-100} max=${HANG_DUMP_MAX:-3} poll=${HANG_DUMP_POLL:-5} tail_n=${HANG_DUMP_TAIL:-600}
wait_s=${HANG_DUMP_WAIT:-5}  # for the stacks to reach the log (a tee in between)
# torchrun's workers run `python -u -m mtrain train ...` (torch/distributed/run.py); SGLang titles its schedulers
# `sglang::scheduler_TP0...` (setproctitle, managers/scheduler.py). The launcher has no handler: SIGUSR1 would kill it.
match=${HANG_DUMP_MATCH:-'(^| )-m mtrain train( |$)|^sglang::scheduler'}
exclude=${HANG_DUMP_EXCLUDE:-'torchrun|torch\.distributed\.run'}
pyspy=$(command -v py-spy || ls "${MTRAIN_SITE:-/tmp/site}/bin/py-spy" 2>/dev/null)

tree() {  # the descendants of $root (not this script's own subtree), one pid a line
    ps -eo pid=,ppid= | awk -v r="$root" -v me=$$ '
        { kids[$2] = kids[$2] " " $1 }
        END { n = split(kids[r], q, " "); while (n > 0) { p = q[n--]; if (p == me) continue; print p;
              m = split(kids[p], k, " "); for (i = 1; i <= m; i++) q[++n] = k[i] } }'
}
has_handler() {  # SigCgt bit of SIGUSR1 (10): a process without a handler would be killed by the signal
    local mask
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$mask" ] && (( (16#$mask >> 9) & 1 ))
}
args_of() { tr '\0\n' '  ' < "/proc/$1/cmdline" 2>/dev/null; }

dump() {  # n: one dump, appended to $outf
    local pids p a size targets=()
    pids=$(tree | paste -sd' ')
    for p in $pids; do
        a=$(args_of "$p")
        [[ $a =~ $match ]] && ! [[ $a =~ $exclude ]] && targets+=("$p")
    done
    (( ${#targets[@]} )) || return 1  # nothing of the run left to ask (e.g. a quiet step after training)
    {
        echo "######## hang dump $1 at $(date -Is): $log quiet for ${idle}s; root pid $root"
        ps -o pid,ppid,etimes,pcpu,rss,stat,wchan:24,args -p "${pids// /,}" 2>&1
        echo "######## nvidia-smi"
        command -v nvidia-smi >/dev/null && { nvidia-smi 2>&1; nvidia-smi --query-compute-apps=pid,used_memory \
            --format=csv 2>&1; } || echo "(no nvidia-smi)"
        size=$(stat -c %s "$log" 2>/dev/null || echo 0)
        echo "######## SIGUSR1 (stacks go to each process's stderr: $log)"
        for p in "${targets[@]}"; do
            if has_handler "$p"; then kill -USR1 "$p" && echo "sent to $p: $(args_of "$p" | cut -c1-160)"
            else echo "NOT sent to $p (no SIGUSR1 handler: SIGUSR1 would kill it):" \
                "$(args_of "$p" | cut -c1-160)"; fi
        done
        sleep "$wait_s"
        echo "######## $log: last $tail_n lines before the signal"
        head -c "$size" "$log" | tail -n "$tail_n"
        echo "######## $log: everything after the signal (the stacks)"
        tail -c +"$((size + 1))" "$log" | head -n 20000
        if [ -n "$pyspy" ]; then
            for p in $pids; do
                [[ $(readlink "/proc/$p/exe" 2>/dev/null) == *python* ]] || continue
                echo "######## py-spy dump --pid $p: $(args_of "$p" | cut -c1-160)"
                timeout 30 "$pyspy" dump --pid "$p" 2>&1
            done
        fi
        echo "######## end of hang dump $1"
    } >> "$outf" 2>&1
    echo "hang_dump.sh: dump $1 of $log into $outf (signaled ${#targets[@]} candidates)"
}

last_size=-1 quiet_since=$(date +%s) n=0
while (( n < max )) && kill -0 "$root" 2>/dev/null; do
    sleep "$poll"
    [ -f "$log" ] || continue
    size=$(stat -c %s "$log" 2>/dev/null || echo 0)
    now=$(date +%s)
    if [ "$size" != "$last_size" ]; then last_size=$size quiet_since=$now; continue; fi
    if (( now - quiet_since >= idle )); then
        dump $((n + 1)) && n=$((n + 1))
        quiet_since=$(date +%s) last_size=$(stat -c %s "$log" 2>/dev/null || echo 0)
    fi
done
