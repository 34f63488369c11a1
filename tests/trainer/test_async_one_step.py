"""rollout.async=one_step under torchrun (2 gloo ranks, reference engines, the tiny model), and the keys' errors.

The run trains; the first step's tokens are version 0 (nothing was generated ahead), every later step's tokens are
exactly one version behind the weights the update starts from (read from the per-token versions the engines wrote,
not from the schedule); the overlap metrics are in metrics.jsonl; the run's config.yaml spells the key
`rollout.async` and loads back.
"""
from __future__ import annotations

import subprocess

import pytest

from loop_harness import CONFIG, SIGNAL_REWARD, base_overrides, env, launch, train_records
from mtrain.config import ConfigError, load_config
from mtrain.job_split import split_ranks


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def test_one_step_torchrun(tiny_hf, tmp_path):
    run = tmp_path / "run"
    # TIS corrects the one-version lag: min(pi_trainer / pi_rollout, cap) per token (the objective's tis/ metrics)
    p = launch(base_overrides(tiny_hf, run, **{"rollout.async": "one_step", "train.steps": 3,
                                               "reward.fn": SIGNAL_REWARD, "rollout.offpolicy": "tis",
                                               "algo.tis_cap": 2.0}), tmp_path, timeout=300)
    assert "placement=colocated: all 2 ranks train and host engines" in p.stdout
    assert "rollout.async=one_step" in p.stdout
    recs = train_records(run)
    assert sorted(recs) == [1, 2, 3]
    # step 1's record is the update from weights 0 (trained on tokens of version 0, generated synchronously);
    # steps 2 and 3 trained on tokens generated while the previous step trained: one version behind, all of them.
    assert recs[1]["rollout/version_lag_mean"] == 0.0 and recs[1]["rollout/tokens_lag_0"] > 0
    for s in (2, 3):
        assert recs[s]["rollout/version_lag_mean"] == 1.0, recs[s]
        assert recs[s]["rollout/tokens_lag_1"] > 0 and "rollout/tokens_lag_0" not in recs[s]
        assert recs[s]["rollout/offpolicy_token_frac"] == 1.0
    for s in (1, 2):  # the steps that generated the next one's groups in the background
        assert 0.0 < recs[s]["perf/engine_busy_frac"] <= 1.0
        assert recs[s]["perf/train_wait_s"] >= 0.0 and recs[s]["time/rollout_background"] > 0.0
    assert "perf/engine_busy_frac" not in recs[3]  # the last step generates nothing ahead
    assert recs[3]["weight_version"] == 3
    for s in (1, 2, 3):
        assert 0.0 < recs[s]["tis/weight_mean"] <= 2.0 and "tis/capped_frac" in recs[s]
    assert (run / "trained_prompts.jsonl").exists()
    saved = (run / "config.yaml").read_text()
    assert "  async: one_step" in saved and "async_mode" not in saved
    assert load_config(run / "config.yaml").rollout.async_mode == "one_step"


def test_mask_drops_tokens_older_than_max_staleness():
    """rollout.offpolicy=mask under asynchrony: a token leaves the loss when step - version > max_staleness (null: 1);
    positions off the response (version -1) keep their mask."""
    import torch
    from types import SimpleNamespace
    from mtrain.trainer.sources.one_step import offpolicy_mask
    versions = torch.tensor([[-1, 5, 4, 3, 2]])
    for staleness, want in ((None, [1, 1, 1, 0, 0]), (2, [1, 1, 1, 1, 0]), (1, [1, 1, 1, 0, 0])):
        batch = SimpleNamespace(versions=versions, response_mask=torch.ones(1, 5))
        offpolicy_mask(batch, 5, SimpleNamespace(offpolicy="mask", max_staleness=staleness,
                                                      async_mode="one_step"))
        assert batch.response_mask.tolist() == [[float(x) for x in want]], staleness
    batch = SimpleNamespace(versions=versions, response_mask=torch.ones(1, 5))
    offpolicy_mask(batch, 5, SimpleNamespace(offpolicy="tis", max_staleness=None, async_mode="one_step"))
    assert batch.response_mask.tolist() == [[1.0] * 5]  # tis keeps every token, weighted in the objective


BAD = [
    (["rollout.async=sometimes"], "rollout.async: 'sometimes' is not one of 'off', 'one_step', 'stream'"),
    (["rollout.async_mode=off"], "unknown config key 'rollout.async_mode'"),
    (["rollout.async=stream", "rollout.max_staleness=0"], "rollout.max_staleness: 0 with rollout.async=stream"),
    (["rollout.async=one_step", "rollout.partial=true"], "rollout.async: one_step with rollout.partial=true"),
    (["rollout.async=one_step", "rollout.offpolicy=tis"], "rollout.offpolicy: tis needs algo.tis_cap"),
    (["rollout.async=one_step", "rollout.max_staleness=0"], "rollout.max_staleness: 0 with rollout.async=one_step"),
    (["engine.placement=both"], "engine.placement: 'both' is not one of 'colocated', 'separate'"),
    (["engine.ranks=2"], "engine.ranks: is for engine.placement=separate"),
    (["engine.placement=separate"], "engine.ranks: engine.placement=separate needs engine.ranks"),
    (["engine.placement=separate", "engine.ranks=3", "engine.tp=2"], "engine.ranks: 3 is not a positive multiple"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["model.hf_path=x", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_yaml_spelling(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG.read_text().replace("  max_prompt_len: 64", "  max_prompt_len: 64\n  async: one_step"))
    assert load_config(f, ["model.hf_path=x"]).rollout.async_mode == "one_step"
    f.write_text(CONFIG.read_text().replace("  max_prompt_len: 64", "  max_prompt_len: 64\n  async: off"))
    assert load_config(f, ["model.hf_path=x"]).rollout.async_mode == "off"  # YAML 1.1 reads `off` as false


SPLITS = [  # (world, overrides, message or the split's training and engine ranks)
    (4, ["engine.placement=separate", "engine.ranks=2"], ((0, 1), (2, 3))),
    (4, ["engine.placement=separate", "engine.ranks=2", "engine.tp=2"], ((0, 1), (2, 3))),
    (8, ["engine.placement=separate", "engine.ranks=4", "parallel.tp=2", "parallel.pp=2"],
     ((0, 1, 2, 3), (4, 5, 6, 7))),
    (4, ["engine.placement=separate", "engine.ranks=4"], "engine.ranks: 4 engine ranks leave no training rank"),
    (4, ["engine.placement=separate", "engine.ranks=2", "parallel.tp=2", "parallel.pp=2"],
     "engine.ranks: 2 engine ranks leave 2 training ranks, not a multiple of parallel.tp x pp x cp = 2 x 2 x 1 = 4"),
    (5, ["engine.placement=separate", "engine.ranks=2", "parallel.tp=2", "parallel.cp=2"],
     "leave 3 training ranks, not a multiple of parallel.tp x pp x cp = 2 x 1 x 2 = 4"),
]


@pytest.mark.parametrize("world,overrides,want", SPLITS)
def test_split(world, overrides, want):
    cfg = load_config(CONFIG, ["model.hf_path=x", *overrides])
    if isinstance(want, str):
        with pytest.raises(ConfigError) as e:
            split_ranks(cfg, world)
        assert want in str(e.value)
        return
    s = split_ranks(cfg, world)
    assert (s.train_ranks, s.engine_ranks) == want
    assert "placement=separate" in s.describe()


def test_separate_refused_before_process_groups(tiny_hf, tmp_path):
    """A split separate placement cannot run is refused by preflight in one line, exit 2: what each of 4 ranks does
    before any process group (preflight reads torchrun's WORLD_SIZE)."""
    import sys
    overrides = base_overrides(tiny_hf, tmp_path / "r", **{"engine.placement": "separate", "engine.ranks": 4,
                                                           "parallel.tp": 1})
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), *overrides], cwd=tmp_path,
        env=dict(env(), WORLD_SIZE="4", RANK="0"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == ("mtrain: error: ConfigError: engine.ranks: 4 engine ranks leave no training rank in a "
                                "job of 4 ranks (torchrun --nproc-per-node x nodes)")
