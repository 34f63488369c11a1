"""rollout.async=one_step and stream survive kill -9 of the whole job at random moments: after `train.resume=auto` runs to the
end, every prompt the sampler handed out for the trained steps was trained exactly once (none lost with the pending
rollout, none trained twice), counted from the run's ledger of trained prompts against an independent replay of
the sampler. stream runs with max_staleness=2 (up to two batches generated ahead when the kill lands). Colocated on
2 gloo ranks, separate on 4 (2 training, 2 engine ranks); CPU; slow (several launches)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections import Counter

import pytest

from loop_harness import base_overrides, env, kill_job, torchrun_cmd
from mtrain.data.sampler import PromptSampler
from test_async_one_step import tiny_hf  # noqa: F401  (fixture)

STEPS, PROMPTS, NUM_TRAIN = 8, 4, 256


def _kill_when(cmd, cwd, run, step: int, extra_s: float, timeout: float = 300) -> None:
    """Start the job; once checkpoint `step` exists, wait `extra_s` more (a random moment of a later step: its
    rollout, update, sync or checkpoint write) and SIGKILL every process of it."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + timeout
    while _latest_step(run) < step and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(extra_s)
    kill_job(p)


def _latest_step(run) -> int:
    steps = [int(p.name.split("_")[-1]) for p in (run / "checkpoints").glob("step_*")
             if p.name.split("_")[-1].isdigit()]
    return max(steps, default=0)


# separate: 2 training ranks (DP 2) + 2 engine ranks
PLACEMENTS = {"colocated": ({}, 2), "separate": ({"engine.placement": "separate", "engine.ranks": 2}, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_kill9_at_random_moments_loses_and_repeats_nothing(tiny_hf, tmp_path, mode, placement):  # noqa: F811
    run = tmp_path / "run"
    extra = {"rollout.max_staleness": 2} if mode == "stream" else {}
    split, nproc = PLACEMENTS[placement]
    overrides = base_overrides(tiny_hf, run, **{"rollout.async": mode, "train.steps": STEPS, **extra, **split,
                                                "train.save_interval": 1, "parallel.tp": 1,
                                                "rollout.prompts_per_step": PROMPTS,
                                                "data.arithmetic.num_train": NUM_TRAIN})
    rng = random.Random(int(os.environ.get("MTRAIN_KILL_SEED", "7")))
    kills = []
    targets = sorted(rng.sample(range(1, STEPS - 1), int(os.environ.get("MTRAIN_KILLS", "4"))))
    for target in targets:
        extra = rng.uniform(0.0, 2.0)
        _kill_when(torchrun_cmd(overrides, nproc), tmp_path, run, target, extra)
        kills.append((target, round(extra, 2), _latest_step(run)))
    assert len({k[2] for k in kills}) > 1  # the kills landed at different points of the run
    p = subprocess.run(torchrun_cmd(overrides, nproc), cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ledger = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines() if x.strip()]
    assert [e["step"] for e in ledger] == list(range(1, STEPS + 1)), ledger
    trained = Counter(i for e in ledger for i in e["prompts"])
    sampler = PromptSampler(NUM_TRAIN, PROMPTS, seed=0, shuffle=True)
    expected = [i for _ in range(STEPS) for i in sampler.next_batch()]
    lost = [i for i in expected if i not in trained]
    twice = {i: c for i, c in trained.items() if c > 1}
    print(f"kills (after checkpoint, + s, latest checkpoint then): {kills}; sampled {len(expected)}, "
          f"trained {sum(trained.values())}, lost {len(lost)}, twice {len(twice)}")
    assert not lost and not twice
    assert [i for e in ledger for i in e["prompts"]] == expected  # the same prompts in the same order
