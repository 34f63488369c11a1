"""The RL loop as users run it: `torchrun --nproc-per-node 2 -m mtrain train ...` on a tiny Llama at TP2.

One uninterrupted 4-step run is the reference; a run stopped after step 2 (train.steps=2, then relaunched with
train.steps=4) and a run SIGKILLed right after its step-2 checkpoint appeared, then relaunched, must log the
same metrics for steps 1-4, exactly, except wall-clock times.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loop_harness import (CONFIG, base_overrides, env, launch, launch_and_kill_after, metrics, train_records,
                          without_time)

STEPS = 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


@pytest.fixture(scope="module")
def reference_run(tiny_llama, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    launch(base_overrides(tiny_llama, run, **{"train.steps": STEPS, "train.save_interval": 2,
                                              "train.eval_interval": 2, "train.val_before_train": "true"}),
           cwd=run.parent)
    return run


def test_grpo_tp2_step_invariants(reference_run):
    recs = train_records(reference_run)
    assert sorted(recs) == [1, 2, 3, 4]
    first = recs[1]
    # Step 1: the policy that scored the rollout is the one being trained, and equals the reference model.
    assert first["ppo/clipfrac"] == 0.0 and first["ppo/approx_kl"] == 0.0 and first["kl/mean"] == 0.0
    for step, r in recs.items():
        assert r["weight_version"] == step
        assert r["logprob_diff/max_abs"] <= 1e-5, (step, r["logprob_diff/max_abs"])
        assert r["update_skipped"] == 0.0 and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["adv/std"] > 0  # the reward has signal: the update is driven by non-zero advantages
    # after updates the policy moved away from the reference
    assert recs[STEPS]["kl/mean"] > 0


def test_val_before_train_and_periodic_eval(reference_run):
    recs = metrics(reference_run)
    assert recs[0]["step"] == 0 and set(recs[0]) == {"step", "eval/reward_mean"}
    assert all("eval/reward_mean" in train_records(reference_run)[s] for s in (2, 4))
    ckpts = reference_run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_4"
    assert all((ckpts / f"step_{s}" / "COMPLETE").is_file() for s in (2, 4))


def _assert_same_metrics(run, reference_run):
    ref, got = metrics(reference_run), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert without_time(a) == without_time(b), f"step {a['step']} differs"


def test_resume_after_stop_is_exact(tiny_llama, reference_run, tmp_path):
    run = tmp_path / "run"
    common = {"train.save_interval": 2, "train.eval_interval": 2, "train.val_before_train": "true"}
    launch(base_overrides(tiny_llama, run, **common, **{"train.steps": 2}), cwd=tmp_path)
    assert max(train_records(run)) == 2
    p = launch(base_overrides(tiny_llama, run, **common, **{"train.steps": STEPS}), cwd=tmp_path)
    assert "resumed from" in p.stdout and "step_2 at step 2" in p.stdout
    _assert_same_metrics(run, reference_run)


def test_resume_after_sigkill_is_exact(tiny_llama, reference_run, tmp_path):
    run = tmp_path / "run"
    over = base_overrides(tiny_llama, run, **{"train.steps": STEPS, "train.save_interval": 2,
                                              "train.eval_interval": 2, "train.val_before_train": "true"})
    launch_and_kill_after(over, cwd=tmp_path, marker=run / "checkpoints" / "step_2" / "COMPLETE")
    assert not (run / "checkpoints" / "step_4").exists()
    p = launch(over, cwd=tmp_path)
    assert "at step 2" in p.stdout
    _assert_same_metrics(run, reference_run)


def test_never_sets_the_earlier_run_aside(tiny_llama, tmp_path):
    """train.resume=never where a 2-step run left checkpoints: that run moves whole into RUN_DIR/previous/<time>/
    (bytes intact, one line saying where), the new 1-step run's checkpoints stand alone, and resume=auto then goes on
    from the new run's step_1, not the earlier run's step_2."""
    run = tmp_path / "run"
    launch(base_overrides(tiny_llama, run, **{"train.steps": 2, "train.save_interval": 1}), cwd=tmp_path)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert {"step_1", "step_2"} <= {p.parts[1] for p in before if p.parts[0] == "checkpoints" and len(p.parts) > 2}
    p = launch(base_overrides(tiny_llama, run, **{"train.steps": 1, "train.resume": "never"}), cwd=tmp_path)
    (moved,) = (run / "previous").iterdir()
    assert p.stdout.count("train.resume=never: the earlier run's") == 1 and str(moved) in p.stdout
    assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()} == before
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["latest", "step_1"]
    p = launch(base_overrides(tiny_llama, run, **{"train.steps": 2}), cwd=tmp_path)
    assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in p.stdout
    assert sorted(train_records(run)) == [1, 2] and len(list((run / "previous").iterdir())) == 1


def test_resume_from_an_earlier_step_sets_the_later_steps_aside(tiny_llama, reference_run, tmp_path):
    """train.resume=RUN_DIR/checkpoints/step_2 where the run went to step 4: steps 3 and 4 (the step_4 checkpoint, their
    metrics rows, config.yaml) move whole into RUN_DIR/previous/<time>/ before any step runs, one line saying so; the
    run dir then holds one history, the same as an uninterrupted run's. Was: step_4 overwritten in place, the rows of
    steps 3-4 dropped. A checkpoint of this run dir given to a run in another run dir leaves this one untouched."""
    run = Path(shutil.copytree(reference_run, tmp_path / "run"))
    before = files(run)
    common = {"train.save_interval": 2, "train.eval_interval": 2, "train.val_before_train": "true"}
    step_2 = run / "checkpoints" / "step_2"
    p = launch(base_overrides(tiny_llama, run, **common, **{"train.steps": STEPS, "train.resume": step_2}),
               cwd=tmp_path)
    (moved,) = (run / "previous").iterdir()
    assert p.stdout.count(f"train.resume={step_2}: this run dir's steps after 2 (checkpoints/step_4") == 1
    assert str(moved) in p.stdout and f"resumed from {step_2} at step 2" in p.stdout
    whole = {k: v for k, v in files(moved).items() if not k.endswith(".jsonl")}
    assert whole == {k: before[k] for k in whole} and "config.yaml" in whole  # bytes intact
    step_4 = {k for k in before if k.startswith("checkpoints/step_4/")}
    assert {k for k in whole if k.startswith("checkpoints/")} == step_4
    old_rows = [x for x in before["metrics.jsonl"].splitlines(keepends=True) if json.loads(x)["step"] > 2]
    assert (moved / "metrics.jsonl").read_bytes() == b"".join(old_rows)
    _assert_same_metrics(run, reference_run)  # steps 0-4 once each, step_4 written again
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]
    kept = files(run)
    launch(base_overrides(tiny_llama, tmp_path / "other", **{"train.steps": 2, "train.resume": step_2}),
           cwd=tmp_path)
    assert files(run) == kept and not (tmp_path / "other" / "previous").exists()


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_plot_writes_png(reference_run, tmp_path):
    out = tmp_path / "curves.png"
    p = subprocess.run([sys.executable, "-m", "mtrain", "plot", str(reference_run), "--out", str(out)],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_unknown_config_key_is_one_line_exit_2(tiny_llama, tmp_path):
    p = subprocess.run([sys.executable, "-m", "mtrain", "train", str(CONFIG), f"model.hf_path={tiny_llama}",
                        "rollout.max_new_tokenz=8"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    # (library import warnings may precede it; the error itself is one line, no traceback)
    lines = [x for x in p.stderr.splitlines() if x.startswith("mtrain: error")]
    assert "Traceback" not in p.stderr
    assert len(lines) == 1 and "unknown config key 'rollout.max_new_tokenz'" in lines[0], p.stderr
    assert "rollout.max_new_tokens" in lines[0]  # the suggestion
