"""engine.placement=separate under torchrun: 4 gloo ranks as 2 training ranks (Megatron TP2 over them only) and 2
engine ranks (reference engines), the tiny model.

The strongest check of the whole path (split, pool on engine ranks only, shard-to-shard sync into engines on other
ranks): a separate run and a colocated run of the same training layout (TP2 on 2 ranks, 2 engines) sample the same
prompts with the same per-request seeds, so when the engines hold bit-equal weights after every sync the
rollouts, hence the rewards, are identical step by step, and the losses agree to the last bits (the reference
engine's batch composition rounds logprobs at ~1e-7). one_step: every later step's tokens one version old, the
overlap metrics logged. Failure: an engine rank that hangs (SIGSTOP) or dies (SIGKILL) ends the job with an error
naming it within train.collective_timeout_s.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from loop_harness import SIGNAL_REWARD, base_overrides, env, launch, torchrun_cmd, train_records
from mtrain.data.sampler import PromptSampler
from test_async_one_step import tiny_hf  # noqa: F401  (fixture)

SEPARATE = {"engine.placement": "separate", "engine.ranks": 2, "parallel.tp": 2, "train.save_interval": -1,
            "reward.fn": SIGNAL_REWARD}


def test_separate_equals_colocated_step_by_step(tiny_hf, tmp_path):  # noqa: F811
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    p = launch(base_overrides(tiny_hf, sep, **SEPARATE, **{"train.steps": 3}), tmp_path, timeout=420, nproc=4)
    assert "placement=separate: training ranks 0-1 (2), engine ranks 2-3 (2: 2 engine(s) of tp 1)" in p.stdout
    launch(base_overrides(tiny_hf, col, **{"parallel.tp": 2, "train.steps": 3, "train.save_interval": -1,
                                           "reward.fn": SIGNAL_REWARD}), tmp_path, timeout=420, nproc=2)
    a, b = train_records(sep), train_records(col)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        assert a[s]["reward/mean"] == b[s]["reward/mean"], (s, a[s]["reward/mean"], b[s]["reward/mean"])
        assert a[s]["response_len/mean"] == b[s]["response_len/mean"]
        assert abs(a[s]["loss/total"] - b[s]["loss/total"]) < 1e-5 and abs(a[s]["grad_norm"] - b[s]["grad_norm"]) < 1e-4, s
        assert a[s]["sync/bytes"] > 0
    assert len({a[s]["reward/mean"] for s in a}) > 1, "the weights changed between steps (the engines saw it)"


@pytest.mark.slow
def test_separate_one_step(tiny_hf, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    p = launch(base_overrides(tiny_hf, run, **SEPARATE, **{"train.steps": 3, "rollout.async": "one_step"}),
               tmp_path, timeout=420, nproc=4)
    assert "rollout.async=one_step" in p.stdout
    recs = train_records(run)
    assert recs[1]["rollout/version_lag_mean"] == 0.0
    for s in (2, 3):
        assert recs[s]["rollout/version_lag_mean"] == 1.0 and recs[s]["rollout/offpolicy_token_frac"] == 1.0
    for s in (1, 2):
        assert 0.0 < recs[s]["perf/engine_busy_frac"] <= 1.0 and recs[s]["perf/train_wait_s"] >= 0.0


def _worker_pid(root: int, rank: int) -> int | None:
    """The torchrun worker of `rank` among the descendants of `root` (its RANK in /proc/PID/environ)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().split()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[3]) == root and f"RANK={rank}".encode() in env and b"-m\0mtrain" in (d / "cmdline").read_bytes():
            return int(d.name)
    return None


def _fail_rank(tiny_hf, tmp_path, rank, sig, timeout_s):
    run = tmp_path / "run"
    overrides = base_overrides(tiny_hf, run, **SEPARATE, **{"train.steps": 40, "train.collective_timeout_s": timeout_s})
    p = subprocess.Popen(torchrun_cmd(overrides, 4), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            if p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the run did not reach its first step:\n{p.communicate(timeout=60)[0][-4000:]}")
            time.sleep(0.5)
        pid = _worker_pid(p.pid, rank)
        assert pid is not None
        os.kill(pid, sig)  # mid-run: in a rollout, an update or a weight transfer
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=timeout_s + 150)
        return p.returncode, out, time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("rank, sig", [(3, signal.SIGSTOP), (3, signal.SIGKILL), (1, signal.SIGSTOP)],
                         ids=["engine-hangs", "engine-dies", "trainer-hangs"])
def test_failed_rank_is_named(tiny_hf, tmp_path, rank, sig):  # noqa: F811
    # the timeout also bounds the start's collectives: 60 s leaves room for a loaded 2-core machine
    rc, out, wall = _fail_rank(tiny_hf, tmp_path, rank, sig, timeout_s=60)
    assert rc != 0
    named = (f"rank {rank}" in out) or (f"rank: {rank}" in out) or (f"ranks {rank}" in out)
    assert named, out[-4000:]
    assert wall < 60 + 90, wall  # the timeout plus teardown: never a silent hang


def test_separate_stream(tiny_hf, tmp_path):  # noqa: F811
    """stream: the engine ranks' generator runs ahead (up to max_staleness batches), the training ranks take the
    batches in order, every update goes into the running generation (the engine ranks pause in place, receive the
    shard-to-shard transfer, continue): no request aborted, every trained token within the bound."""
    run, steps, bound = tmp_path / "run", 4, 2
    p = launch(base_overrides(tiny_hf, run, **SEPARATE, **{"train.steps": steps, "rollout.async": "stream",
                                                            "rollout.max_staleness": bound,
                                                            "rollout.max_new_tokens": 24}),
               tmp_path, timeout=420, nproc=4)
    assert "rollout.async=stream" in p.stdout and "placement=separate" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == list(range(1, steps + 1))
    for s, r in recs.items():
        lags = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("rollout/tokens_lag_")}
        assert lags and 0 <= min(lags) and max(lags) <= bound, (s, lags)
        assert r["rollout/staleness_max"] == max(lags) <= bound and r["rollout/stale_groups_dropped"] == 0.0
        assert r["rollout/aborted_per_update"] == 0.0 and r["rollout/pause_s"] > 0.0  # engine ranks paused
        assert 0.0 < r["reward/mean"] <= 1.0 and r["response_len/mean"] > 0 and r["sync/bytes"] > 0
    assert any(recs[s]["rollout/offpolicy_token_frac"] > 0 for s in range(2, steps + 1))  # generated while training
    ledger = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines()]
    sampler = PromptSampler(256, 4, seed=0, shuffle=True)
    assert [x["prompts"] for x in ledger] == [sampler.next_batch() for _ in range(steps)]  # in order, none twice
