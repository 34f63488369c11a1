"""rollout.async=stream under torchrun (2 gloo ranks, reference engines, the tiny model).

The run trains; every trained token's version (written by the engines, per token) is within rollout.max_staleness of
the step that trains it; weight updates went into running generation without aborting anything; the timeline
metrics are in metrics.jsonl. With max_staleness=2 the generator runs up to two batches ahead.
"""
from __future__ import annotations

import json

import pytest

from loop_harness import SIGNAL_REWARD, base_overrides, launch, train_records


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


@pytest.mark.parametrize("staleness", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_stream_torchrun(tiny_hf, tmp_path, staleness):
    run = tmp_path / "run"
    steps = 4
    p = launch(base_overrides(tiny_hf, run, **{"rollout.async": "stream", "train.steps": steps,
                                                "rollout.max_staleness": staleness, "reward.fn": SIGNAL_REWARD,
                                                "rollout.max_new_tokens": 24}), tmp_path, timeout=400)
    assert "rollout.async=stream" in p.stdout
    assert "rollout.async=stream: engine and trainer share host memory on CPU; no device-memory fit check" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        r = recs[s]
        trained_at = s - 1  # record s is the update that step s-1 made, from weights s-1
        lags = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("rollout/tokens_lag_")}
        assert lags and max(lags) <= staleness and min(lags) >= 0, (s, lags)
        assert r["rollout/staleness_max"] == max(lags) and r["rollout/stale_groups_dropped"] == 0.0
        assert r["rollout/aborted_per_update"] == 0.0 and r["rollout/pause_s"] > 0.0
        assert 0.0 <= r["perf/engine_busy_frac"] <= 1.0 and r["perf/train_wait_s"] >= 0.0
        assert r["weight_version"] == s and trained_at >= 0
    # after the first step the engines generated while training ran: some trained tokens are off-policy
    assert any(recs[s]["rollout/offpolicy_token_frac"] > 0 for s in range(2, steps + 1))
    ledger = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in ledger] == list(range(1, steps + 1))
    prompts = [i for x in ledger for i in x["prompts"]]
    assert len(prompts) == len(set(prompts)) or len(prompts) > 8  # (the tiny set may wrap around an epoch)


def test_stream_tools_torchrun(tmp_path):
    """stream with multi_turn.rollout_fn (the calculator tool rollout): updates in place land between or inside
    turns; every trained token (read from the per-token versions the turns recorded) within the bound, nothing
    aborted or dropped, the engines' logprobs equal the trainer's at step 1 (float32), every prompt trained once."""
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", seed=0, overrides={"max_position_embeddings": 1024})  # the tools'
    run = tmp_path / "run"  # system prompt alone is ~500 characters of the char tokenizer
    steps = 3
    launch(base_overrides(hf, run, **{"rollout.async": "stream", "train.steps": steps, "reward.fn": SIGNAL_REWARD,
                                           "multi_turn.rollout_fn": "mtrain.rollout.agents.multi_turn:rollout_group",
                                           "multi_turn.tools": "calculator", "multi_turn.max_turns": 2,
                                           "multi_turn.max_total_tokens": 700, "rollout.max_prompt_len": 600,
                                           "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
                                           "train.micro_batch_size": 2, "model.dtype": "float32"}),
           tmp_path, timeout=400)
    recs = train_records(run)
    assert sorted(recs) == list(range(1, steps + 1))
    assert recs[1]["logprob_diff/max_abs"] <= 1e-5 and recs[1]["rollout/version_lag_mean"] == 0.0
    for s in range(1, steps + 1):
        lags = {int(k.rsplit("_", 1)[1]) for k in recs[s] if k.startswith("rollout/tokens_lag_")}
        assert lags and lags <= {0, 1}, (s, recs[s])
        assert recs[s]["rollout/stale_groups_dropped"] == 0.0 and recs[s]["rollout/aborted_per_update"] == 0.0
        assert any(k.startswith("tools/") for k in recs[s])
    ledger = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines()]
    prompts = [i for x in ledger for i in x["prompts"]]
    assert [x["step"] for x in ledger] == list(range(1, steps + 1)) and len(prompts) == len(set(prompts)) == 2 * steps
