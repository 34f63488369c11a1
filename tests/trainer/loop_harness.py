"""Shared plumbing for the RL-loop tests: a tiny random HF model, configs, real multi-process launches.

Two ways to run the loop, both real: `launch` runs `torchrun -m mtrain train` (the user's command) in a
subprocess; `run_on_ranks` (mtrain.dist) calls the Trainer directly in 2 spawned ranks when a test needs to
look inside (engine weights, injected failures).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
SIGNAL_REWARD = f"{REPO / 'tests' / 'trainer' / 'signal_reward.py'}:digit_share"
TEST_REWARDS = REPO / "tests" / "trainer" / "rewards_for_tests.py"
# Metrics that differ between two runs of the same config: wall-clock times and throughputs, and the engine-vs-trainer
# logprob gap (the reference engine batches whatever requests are queued when it is free, and CPU BLAS rounds a row's
# last bits by batch size: the tokens are identical, the engine's logprobs agree to ~1e-7), and how many groups each
# engine happened to take from the shared queue (which engine frees first; a CI run had 2/2 against 1/3) and so how
# many engines served the step (1.0 against 2.0 at step 3 of a resumed run).
TIME_KEYS = ("time/", "perf/", "logprob_diff/", "rollout/groups_per_engine_", "rollout/engines")


def env() -> dict[str, str]:
    # this checkout's code, whatever an installed copy holds (the runs start outside the repository)
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(REPO))


def base_overrides(hf: Path, run_dir: Path, **extra) -> list[str]:
    o = {"model.hf_path": hf, "train.run_dir": run_dir, "reward.fn": SIGNAL_REWARD, "train.steps": 3,
         "train.save_interval": 0, "train.eval_interval": 0, "parallel.tp": 2, "train.resume": "auto"}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def torchrun_cmd(overrides: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "mtrain", "train", str(CONFIG), *overrides]


def launch(overrides: list[str], cwd: Path, timeout: float = 180, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC -m mtrain train CONFIG overrides` from outside the repo; raises on failure."""
    p = subprocess.run(torchrun_cmd(overrides, nproc), cwd=cwd, env=env(), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def launch_and_kill_after(overrides: list[str], cwd: Path, marker: Path, timeout: float = 180,
                          nproc: int = 2) -> None:
    """Start a run and SIGKILL its whole process group as soon as `marker` exists (a real crash, no cleanup)."""
    p = subprocess.Popen(torchrun_cmd(overrides, nproc), cwd=cwd, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if p.poll() is not None:
                raise AssertionError(f"run exited ({p.returncode}) before {marker} appeared")
            if time.monotonic() > deadline:
                raise AssertionError(f"{marker} did not appear within {timeout} s")
            time.sleep(0.05)
    finally:
        kill_job(p)


def kill_job(p: subprocess.Popen) -> None:
    """SIGKILL a torchrun job started with start_new_session=True. torchrun starts each worker in a session of its
    own: kill the workers by pid, then torchrun's group, and wait for all of them."""
    import psutil
    procs = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
    for child in procs:
        child.send_signal(signal.SIGKILL)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    psutil.wait_procs(procs, timeout=30)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def without_time(rec: dict) -> dict:
    """A step's record without what depends on the machine's moment: times and measured process peaks
    (mem/*/peak_*: RSS, CUDA); the state byte counts stay (they are deterministic)."""
    return {k: v for k, v in rec.items() if not k.startswith(TIME_KEYS) and not (k.startswith("mem/") and "/peak_" in k)}


def train_records(run_dir: Path) -> dict[int, dict]:
    """step -> the training record of that step (eval-only lines, e.g. step 0, are left out)."""
    return {r["step"]: r for r in metrics(run_dir) if "weight_version" in r}
