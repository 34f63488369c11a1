"""benchmarks/gpu_async_one_step.sh's exit status is its runs' verdict, checked on a CPU with a stand-in trainer: 0
after every run trained all its steps and the comparison was made; 1 when a run's trainer failed (even with all
its steps in metrics.jsonl) or trained fewer steps. (Its runs used to go through examples/smollm2/run.sh, whose
summary step needs an eval at step 0 that these timing runs leave out: run.sh exited 1 after runs that trained.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# `python` on PATH for the script: the trainer launch writes STEPS records into train.run_dir and exits with the
# status FAIL_MODE/SHORT_MODE ask for; any other call (async_compare.py) is the real interpreter.
FAKE = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo /nonexistent/smollm2-hf; exit 0; fi
if [ "$1 $2" != "-m torch.distributed.run" ]; then exec "$REAL_PYTHON" "$@"; fi
run=""; mode=""
for a in "$@"; do
    case $a in train.run_dir=*) run=${a#train.run_dir=} ;; rollout.async=*) mode=${a#rollout.async=} ;; esac
done
mkdir -p "$run"
printf 'rollout:\n  prompts_per_step: 4\n  samples_per_prompt: 2\n' > "$run/config.yaml"
n=$STEPS; [ "$mode" = "${SHORT_MODE:-}" ] && n=$((STEPS - 1))
for i in $(seq 1 "$n"); do
    rec="\"step\": $i, \"weight_version\": $i, \"time/step\": 0.5, \"time/rollout\": 0.2, \"time/train\": 0.3"
    echo "{$rec, \"reward/mean\": 0.$i, \"response_len/mean\": 10.0}" >> "$run/metrics.jsonl"
done
[ "$mode" = "${FAIL_MODE:-}" ] && exit 1
exit 0
"""


def _run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    e = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", REAL_PYTHON=sys.executable, STEPS="4", REPEATS="1",
             OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", "benchmarks/gpu_async_one_step.sh"], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=120)


def test_runs_that_trained_every_step_exit_0(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("trainer exit 0, 4 of 4 steps trained") == 3 and '"speedup_one_step"' in p.stdout, p.stdout


@pytest.mark.parametrize("env,line", [({"FAIL_MODE": "one_step"}, "one_step repeat 1: trainer exit 1, 4 of 4"),
                                      ({"SHORT_MODE": "stream"}, "stream repeat 1: trainer exit 0, 3 of 4")])
def test_a_failed_or_short_run_exits_1(tmp_path, env, line):
    p = _run(tmp_path, **env)
    assert p.returncode == 1 and line in p.stdout, p.stdout + p.stderr
    assert "1 run(s) failed or short of 4 steps" in p.stdout, p.stdout
