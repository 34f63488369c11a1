"""rollout.async=one_step: a rank that hangs in the middle of a background rollout ends the job within
train.collective_timeout_s with an error naming it (2 gloo ranks under torchrun, the tiny model)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from loop_harness import base_overrides, env, torchrun_cmd
from test_async_one_step import tiny_hf  # noqa: F401  (fixture)

HANG = f"{Path(__file__).resolve().parent / 'hang_reward.py'}:hang_on_rank1"
TIMEOUT_S = 15


@pytest.mark.slow
def test_hung_rank_is_named_within_the_timeout(tiny_hf, tmp_path):  # noqa: F811
    overrides = base_overrides(tiny_hf, tmp_path / "run", **{
        "rollout.async": "one_step", "train.steps": 4, "reward.fn": HANG, "parallel.tp": 1,
        "train.collective_timeout_s": TIMEOUT_S})
    t0 = time.monotonic()
    p = subprocess.run(torchrun_cmd(overrides), cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=300)
    wall = time.monotonic() - t0
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert "rank 1 (engine 1) did not reach the end of the rollout (dead or hung" in err, err[-4000:]
    assert wall < TIMEOUT_S + 90, wall  # start-up + the first step + the timeout: no silent hang
