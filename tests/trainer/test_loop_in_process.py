"""The Trainer driven directly in 2 real gloo ranks (mtrain.dist.run_on_ranks), where a test must look inside:
the engine's weights after a sync, the DAPO filter against the rewards actually scored, and failures injected
through real code paths (a reward that raises, an engine shut down mid-rollout), which must stop every rank
with one clear error and leave the last good checkpoint as it was.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from loop_harness import CONFIG, TEST_REWARDS, base_overrides, without_time
from mtrain.dist import run_on_ranks


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def _trainer(hf, run_dir, **extra):
    from mtrain.config import load_config
    from mtrain.trainer.loop import Trainer
    return Trainer(load_config(CONFIG, base_overrides(hf, run_dir, **extra)))


def _hf_weights(hf) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    from mtrain.rollout.reference_engine import hf_disk_views
    return {k: v.detach().clone() for k, v in hf_disk_views(engine._model).items()}


# ------------------------------------------------------------------------------------------------ PP2
def _pp2_steps(rank, world, hf, run_dir):
    t = _trainer(hf, run_dir, **{"parallel.tp": 1, "parallel.pp": 2, "train.steps": 3})
    out = {"records": []}
    if rank == 0:
        disk = _hf_weights(hf)
        initial = _engine_weights(t.engine)
        out["initial_equal_disk"] = all(torch.equal(initial[k], disk[k]) for k in initial)
        out["initial_version"] = t.engine.weight_version
    for _ in range(3):
        out["records"].append(t.train_step())
        if rank == 0:
            now = _engine_weights(t.engine)
            out.setdefault("changed", []).append(sum(not torch.equal(now[k], initial[k]) for k in now) / len(now))
            out.setdefault("engine_version", []).append(t.engine.weight_version)
    t.close()
    return out


def test_grpo_pp2_invariants_and_engine_weights_move(tiny_llama, tmp_path):
    res = run_on_ranks(_pp2_steps, 2, tiny_llama, tmp_path / "run", timeout=240)
    lead = res[0]
    assert lead["initial_equal_disk"] and lead["initial_version"] == 0
    assert lead["engine_version"] == [1, 2, 3]
    for step, r in enumerate(lead["records"], 1):
        assert r["weight_version"] == step
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["adv/std"] > 0 and r["grad_norm"] > 0
    first = lead["records"][0]
    assert first["ppo/clipfrac"] == 0.0 and first["ppo/approx_kl"] == 0.0 and first["kl/mean"] == 0.0
    # Non-zero advantages moved (nearly) every weight of the engine after the first synced step.
    assert lead["changed"][0] > 0.9, lead["changed"]
    def reduced(r):  # wall-clock times and the bytes the leader handed to its engine are per-rank
        return {k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "sync/"))}
    assert [reduced(r) for r in res[1]["records"]] == [reduced(r) for r in lead["records"]]


# ------------------------------------------------------------------------------------------------ DAPO
def _dapo_steps(rank, world, hf, run_dir):
    t = _trainer(hf, run_dir, **{"algo.name": "dapo", "reward.fn": f"{TEST_REWARDS}:odd_answers_only"})
    out = {"records": [], "rewards": []}
    rollout = t.generate

    def scored(*args, **kwargs):  # the rewards every rank receives from the pool, in group order
        res = rollout(*args, **kwargs)
        out["rewards"].append(list(res.rewards))
        return res

    t.generate = scored  # the generation function every source calls
    for _ in range(2):
        out["records"].append(t.train_step())
    before = _engine_weights(t.engine) if rank == 0 else None
    rollout.reward_fn = rollout.reward_fn.__globals__["constant"]  # every group uniform: nothing to train on
    out["records"].append(t.train_step())
    if rank == 0:
        after = _engine_weights(t.engine)
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    t.generate = rollout
    t.close()
    return out


def test_dapo_drops_uniform_groups(tiny_llama, tmp_path):
    lead = run_on_ranks(_dapo_steps, 2, tiny_llama, tmp_path / "run", timeout=240)[0]
    n = 4  # samples_per_prompt of the config
    for rec, rewards in zip(lead["records"][:2], lead["rewards"]):
        groups = [rewards[i:i + n] for i in range(0, len(rewards), n)]
        uniform = sum(len(set(g)) == 1 for g in groups)
        assert rec["filter/dropped_groups"] == uniform and rec["filter/kept_groups"] == len(groups) - uniform
        if uniform < len(groups):
            assert rec["update_skipped"] == 0.0 and rec["logprob_diff/max_abs"] <= 1e-5
    assert any(r["filter/dropped_groups"] > 0 for r in lead["records"][:2])  # even answers exist in 8 prompts
    last = lead["records"][2]
    assert last["filter/dropped_groups"] == 4 and last["filter/kept_groups"] == 0
    assert last["update_skipped"] == 1.0 and last["weight_version"] == 3  # still synced and logged
    assert lead["unchanged"]


# ------------------------------------------------------------------------------------------------ val_only
def _val_only(rank, world, hf, run_dir):
    import torch.distributed as dist
    t = _trainer(hf, run_dir, **{"train.val_only": "true"})
    t.run()
    t.finish()  # what `mtrain train` does after a run every rank completed
    return {"group_left": dist.is_initialized(), "attributes_left": sorted(vars(t))}


def test_val_only_logs_eval_at_step_0(tiny_llama, tmp_path):
    run = tmp_path / "run"
    for res in run_on_ranks(_val_only, 2, tiny_llama, run, timeout=240):
        assert res == {"group_left": False, "attributes_left": []}  # finish() tore everything down on each rank
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["step"] == 0 and 0.0 <= recs[0]["eval/reward_mean"] <= 1.0
    assert not (run / "checkpoints").exists()


def _no_save(rank, world, hf, run_dir):
    t = _trainer(hf, run_dir, **{"train.steps": 1, "train.save_interval": -1})
    t.run()
    t.close()


def test_save_interval_minus_one_writes_no_checkpoint(tiny_llama, tmp_path):
    run = tmp_path / "run"
    run_on_ranks(_no_save, 2, tiny_llama, run, timeout=240)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------ failures
def _ckpt_state(run_dir: Path) -> dict:
    root = run_dir / "checkpoints"
    return {"latest": (root / "latest").read_text(),
            "files": sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))}


def _expect(out, case, fn):
    try:
        fn()
        out[case] = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        out[case] = (type(e).__name__, str(e))


def _shutdown_mid_rollout(engine):
    """Shut the engine down from another thread once it has produced tokens (a real engine death)."""
    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(v > 0 for v in engine.active_requests().values()):
                engine.shutdown()
                return
            time.sleep(0.0005)
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    return th


def _failures(rank, world, hf, run_dir):
    from mtrain.trainer import checkpoint
    # One engine (engine.tp=2, on rank 0): the watcher below must catch the engine that serves the rollout.
    t = _trainer(hf, run_dir, **{"train.steps": 2, "train.save_interval": 2, "engine.tp": 2})
    t.run()
    good = _ckpt_state(run_dir)
    out = {}
    rewards = t.generate.reward_fn  # the generation function scores its groups
    t.generate.reward_fn = rewards.__globals__.get("raises") or _load(f"{TEST_REWARDS}:raises")
    _expect(out, "reward_raises", t.train_step)
    t.generate.reward_fn = _load(f"{TEST_REWARDS}:not_a_number")
    _expect(out, "reward_nan", t.train_step)
    t.generate.reward_fn = rewards
    t.cfg.rollout.max_prompt_len = 3
    _expect(out, "prompt_too_long", t.train_step)
    t.cfg.rollout.max_prompt_len = 64
    t.cfg.rollout.max_new_tokens = 250  # max_position_embeddings of the tiny model is 256
    _expect(out, "context_overflow", t.train_step)
    t.cfg.rollout.max_new_tokens = 48
    watcher = _shutdown_mid_rollout(t.engine) if rank == 0 else None
    _expect(out, "engine_dies", t.train_step)
    if watcher:
        watcher.join()
    out["step"] = t.step
    out["ckpt_unchanged"] = _ckpt_state(run_dir) == good
    now = _ckpt_state(run_dir)
    out["ckpt_diff"] = (set(good["files"]) ^ set(now["files"]), good["latest"], now["latest"])
    import torch.distributed as dist
    dist.barrier()  # every rank has looked at the checkpoints before rank 0 adds the leftovers below
    if rank == 0:  # leftovers of saves that died half-way must never be resumed from
        (run_dir / "checkpoints" / ".partial_step_4" / "mcore").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_6" / "mcore").mkdir(parents=True)
    dist.barrier()
    out["latest_found"] = checkpoint.find_latest(run_dir).name
    return out


def _load(spec):
    from mtrain.data.rewards import load_reward_fn
    return load_reward_fn(spec)


def test_failures_stop_every_rank_and_keep_the_checkpoint(tiny_llama, tmp_path):
    res = run_on_ranks(_failures, 2, tiny_llama, tmp_path / "run", timeout=300)
    cases = ("reward_raises", "reward_nan", "prompt_too_long", "context_overflow", "engine_dies")
    assert [res[0][c] for c in cases] == [res[1][c] for c in cases]  # the same error on every rank
    for out in res:
        kind, msg = out["reward_raises"]
        assert kind == "RewardError" and "raised ZeroDivisionError: reward backend exploded" in msg
        assert "'raises' on sample" in msg
        kind, msg = out["reward_nan"]
        assert kind == "RewardError" and "returned '1.0' (str); expected a finite number" in msg
        kind, msg = out["prompt_too_long"]
        assert kind == "PromptError" and "rollout.max_prompt_len=3" in msg and msg.startswith("sample ")
        kind, msg = out["context_overflow"]
        assert kind == "PromptError" and "max_position_embeddings=256" in msg and "max_new_tokens=250" in msg
        kind, msg = out["engine_dies"]
        assert kind == "EngineError", msg
        assert "aborted" in msg or "shut down" in msg, msg
        assert out["step"] == 2 and out["latest_found"] == "step_2"
    assert res[0]["ckpt_unchanged"], res[0]["ckpt_diff"]


# ------------------------------------------------------------------------------------------------ push vs pull
def _sync_mode_steps(rank, world, hf, run_dir, mode):
    t = _trainer(hf, run_dir, **{"parallel.tp": 2, "train.steps": 2, "sync.mode": mode})
    assert t.sync.mode == mode
    records = [t.train_step() for _ in range(2)]
    weights = _engine_weights(t.engine) if rank == 0 else None
    t.close()
    return records, weights


def test_pull_and_push_syncs_train_identically(tiny_llama, tmp_path):
    """Training TP2: rank 1's slices reach the leader over gloo; pull (the engine writes itself from the trainer's
    tensors and a persistent receive buffer) and push (buckets) leave the engine with the same bits every step."""
    push = run_on_ranks(_sync_mode_steps, 2, tiny_llama, tmp_path / "push", "push", timeout=240)[0]
    pull = run_on_ranks(_sync_mode_steps, 2, tiny_llama, tmp_path / "pull", "pull", timeout=240)[0]
    assert [without_time(r) for r in pull[0]] == [without_time(r) for r in push[0]]  # peak RSS varies run to run
    assert pull[1].keys() == push[1].keys() and all(torch.equal(pull[1][k], push[1][k]) for k in push[1])
    assert all(r["logprob_diff/max_abs"] <= 1e-5 for r in pull[0])
