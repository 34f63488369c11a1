"""What a user and a failing cluster meet (issue 19): readable output, damaged checkpoints, a killed launcher.

One real 2-rank run (`torchrun -m mtrain train`, tiny Llama, TP2, a checkpoint after each of 2 steps) is shared:
its output and files are checked as they are, then copies of its checkpoints are damaged and resumed from.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loop_harness import base_overrides, env, launch, torchrun_cmd
from mtrain.trainer.checkpoint import checkpoint_problem


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


@pytest.fixture(scope="module")
def first_run(tiny_llama, tmp_path_factory):
    run = tmp_path_factory.mktemp("first") / "run"
    p = launch(base_overrides(tiny_llama, run, **{"train.steps": 2, "train.save_interval": 1,
                                              "train.val_before_train": "true"}), cwd=run.parent)
    return run, p


def test_output_is_short_and_warnings_appear_once(first_run):
    run, p = first_run
    # No library warnings at all (the known harmless ones are silenced, ranks other than 0 show none),
    # no TensorBoard notice, no 100-line config dump: a four-line summary, then the progress bar.
    assert "Warning" not in p.stderr and "warnings.warn" not in p.stderr, p.stderr
    assert "TensorBoard" not in p.stderr + p.stdout
    summary = [line for line in p.stdout.splitlines() if line.startswith("mtrain: ")]
    assert len(summary) == 4 and "tp=2" in summary[1] and "config.yaml" in summary[3], p.stdout
    assert "hf_path:" not in p.stdout  # the full config is in the run dir, not on screen
    assert "hf_path:" in (run / "config.yaml").read_text()


def test_eval_shows_progress_and_prints_its_score(first_run):
    run, p = first_run
    # the 16 eval prompts go in chunks: the bar moves while they generate (it was one frozen call)
    import re
    counts = {int(c) for c in re.findall(r"eval at step 0: .*?\| *(\d+)/16", p.stderr)}
    assert len(counts - {0, 16}) >= 1, p.stderr  # at least one count between start and end was shown
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("eval at step 0: eval/reward_mean")]
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert logged["step"] == 0 and f"{logged['eval/reward_mean']:.4f} over 16 prompts x 1 sample(s)" in line


def test_files_follow_the_umask(first_run):
    run, _ = first_run
    want = 0o666 & ~0o022  # the harness runs under the default umask; check it is that one
    mask = os.umask(0o022)
    os.umask(mask)
    if mask != 0o022:
        pytest.skip(f"umask is {mask:o}")
    for f in ("config.yaml", "metrics.jsonl", "eval_samples.jsonl", "checkpoints/step_2/trainer_state.pt"):
        path = run / f
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == want, (f, oct(path.stat().st_mode))
    assert stat.S_IMODE((run / "config.yaml").stat().st_mode) == want  # was 0600 (mkstemp)


def damaged_copy(run: Path, tmp_path: Path) -> Path:
    out = Path(shutil.copytree(run, tmp_path / "run"))
    shard = sorted((out / "checkpoints" / "step_2" / "mcore").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # cut short, as a full disk leaves it
    return out


def test_resume_falls_back_to_the_newest_intact_checkpoint(first_run, tiny_llama, tmp_path):
    run = damaged_copy(first_run[0], tmp_path)
    assert "truncated shard" in checkpoint_problem(run / "checkpoints" / "step_2")
    assert checkpoint_problem(run / "checkpoints" / "step_1") is None
    p = launch(base_overrides(tiny_llama, run, **{"train.steps": 2, "train.save_interval": 1}), cwd=tmp_path)
    assert "resume: skipping step_2: " in p.stdout and "truncated shard" in p.stdout, p.stdout
    assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in p.stdout
    assert p.stdout.count("skipping step_2") == 1  # said once, by rank 0
    assert checkpoint_problem(run / "checkpoints" / "step_2") is None  # step 2 ran again and was saved whole


@pytest.mark.parametrize("name", ["trainer_state.pt", "rng_rank1.pt"])
def test_a_cut_short_state_file_is_found_before_loading(first_run, tmp_path, name):
    # was torch.load's "PytorchStreamReader failed reading zip archive" traceback once the models were built
    from mtrain.trainer.checkpoint import find_latest
    run = Path(shutil.copytree(first_run[0], tmp_path / "run"))
    f = run / "checkpoints" / "step_2" / name
    f.write_bytes(f.read_bytes()[:100])
    assert checkpoint_problem(f.parent) == f"{f}: cut short or damaged (not a readable torch.save file)"
    said = []
    assert find_latest(run, report=said.append) == run / "checkpoints" / "step_1"
    assert said == [f"resume: skipping step_2: {f}: cut short or damaged (not a readable torch.save file)"]


def test_damaged_mcore_ckpt_is_one_line_before_any_rank_starts_work(first_run, tiny_llama, tmp_path):
    run = damaged_copy(first_run[0], tmp_path)
    cmd = torchrun_cmd(base_overrides(tiny_llama, tmp_path / "new",
                                      **{"model.mcore_ckpt": run / "checkpoints" / "step_2" / "mcore"}))
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("mtrain: error")]
    # each rank prints the line (torchrun stops the others when the first exits): once or twice, always whole
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1, p.stderr
    assert "model.mcore_ckpt:" in errors[0] and "truncated shard" in errors[0], p.stderr
    # No rank printed a traceback; the one traceback is torchrun's own report that a worker exited non-zero.
    assert p.stderr.count("Traceback") <= 1 and "torch/distributed/run.py" in p.stderr.split("Traceback")[-1]
    assert not (tmp_path / "new").exists()


def test_workers_stop_when_the_launcher_is_killed(tiny_llama, tmp_path):
    import psutil
    run = tmp_path / "run"
    over = base_overrides(tiny_llama, run, **{"train.steps": 1000, "train.save_interval": 1})
    p = subprocess.Popen(torchrun_cmd(over), cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_1" / "COMPLETE").exists():
            assert p.poll() is None and time.monotonic() < deadline, "the run did not reach its first checkpoint"
            time.sleep(0.1)
        workers = psutil.Process(p.pid).children(recursive=True)
        assert len(workers) >= 2
        p.send_signal(signal.SIGKILL)  # torchrun only: its workers live in sessions of their own
        p.wait()
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers still running {time.monotonic() - t0:.0f} s after the launcher died"
        assert time.monotonic() - t0 < 10
    finally:
        for w in psutil.Process(os.getpid()).children(recursive=True):
            w.kill()
    # Nothing is written after the stop, and every checkpoint directory that looks like one is whole.
    before = sorted(str(f) for f in run.rglob("*"))
    time.sleep(2)
    assert sorted(str(f) for f in run.rglob("*")) == before
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert steps and all(checkpoint_problem(s) is None for s in steps), [checkpoint_problem(s) for s in steps]
