"""rollout.async=one_step and stream with serve.agent under torchrun (2 gloo ranks colocated, reference engines, the
tiny model): OpenAI-client agents (two turns each, the real `openai` client) run on the background pool, through
fronts of its own engine clients, while the step trains.

Checked from the run's own records: exit 0; every trained token's version as the mode promises (one_step: step 1's
tokens version 0, every later step's exactly one version old; stream: never more than rollout.max_staleness old),
read from the per-token versions the agents' sessions recorded; the engines' logprobs equal the trainer's at step 1
(float32); each agent run recorded once (samples x prompts sessions of 2 calls each, every prompt trained once in
the ledger). one_step also survives a kill -9 of the job after its first checkpoint: after `train.resume=auto`,
every prompt the sampler handed out is in the ledger exactly once.
"""
from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest

from loop_harness import base_overrides, env, kill_job, launch, torchrun_cmd, train_records
from mtrain.data.sampler import PromptSampler
from test_async_one_step import tiny_hf  # noqa: F401  (fixture)
from test_separate_agents import AGENTS

STEPS, PROMPTS, N, NUM_TRAIN = 3, 2, 2, 64


def _overrides(tiny_hf, run, mode, **extra):  # noqa: F811
    return base_overrides(tiny_hf, run, **{"rollout.async": mode, "serve.agent": f"{AGENTS}:two_turn_digits",
                                           "train.steps": STEPS, "rollout.prompts_per_step": PROMPTS,
                                           "rollout.samples_per_prompt": N, "train.micro_batch_size": 2,
                                           "data.arithmetic.num_train": NUM_TRAIN, **extra})


def _ledger(run) -> list[dict]:
    return [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines() if x.strip()]


def _expected_prompts() -> list[int]:
    sampler = PromptSampler(NUM_TRAIN, PROMPTS, seed=0, shuffle=True)
    return [i for _ in range(STEPS) for i in sampler.next_batch()]


def _check_runs_recorded_once(run, recs) -> None:
    ledger = _ledger(run)
    assert [e["step"] for e in ledger] == list(range(1, STEPS + 1)), ledger
    assert [i for e in ledger for i in e["prompts"]] == _expected_prompts()  # every prompt once, in order
    for s, rec in recs.items():
        # PROMPTS x N agent runs, each one session of the agent's two calls on one branch (none lost or repeated:
        # a lost run leaves the group short, a repeated one a second branch)
        assert rec["session/calls"] == 2.0 and rec["session/branches"] == 2.0 and rec["session/leaves"] == 1.0, rec
        tokens = sum(v for k, v in rec.items() if k.startswith("rollout/tokens_lag_"))
        assert tokens > 0


@pytest.mark.parametrize("mode", ["one_step", "stream"])
def test_agents_async_torchrun(tiny_hf, tmp_path, mode):  # noqa: F811
    run = tmp_path / "run"
    p = launch(_overrides(tiny_hf, run, mode), tmp_path, timeout=400)
    assert f"rollout.async={mode}" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == [1, 2, 3]
    assert recs[1]["logprob_diff/max_abs"] <= 1e-5, recs[1]["logprob_diff/max_abs"]
    assert recs[1]["rollout/tokens_lag_0"] > 0 and recs[1]["rollout/version_lag_mean"] == 0.0
    for s in (2, 3):
        lags = {int(k.rsplit("_", 1)[1]) for k in recs[s] if k.startswith("rollout/tokens_lag_")}
        if mode == "one_step":  # generated while the previous step trained: one version old, every token
            assert lags == {1} and recs[s]["rollout/version_lag_mean"] == 1.0, recs[s]
        else:  # within the staleness bound (1): a batch may mix versions where an update landed mid-run
            assert lags and lags <= {0, 1}, recs[s]
            assert recs[s]["rollout/stale_groups_dropped"] == 0.0
    _check_runs_recorded_once(run, recs)


def test_agents_one_step_kill9_resume(tiny_hf, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    overrides = _overrides(tiny_hf, run, "one_step", **{"train.save_interval": 1, "parallel.tp": 1})
    proc = subprocess.Popen(torchrun_cmd(overrides), cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_1").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # inside step 2: its update, or the background agents of step 3
    kill_job(proc)
    p = subprocess.run(torchrun_cmd(overrides), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    trained = Counter(i for e in _ledger(run) for i in e["prompts"])
    assert sorted(trained) == sorted(set(_expected_prompts())) and set(trained.values()) == {1}, trained
