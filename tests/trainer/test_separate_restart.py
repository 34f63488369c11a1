"""engine.placement=separate writes checkpoints and resumes from them: 4 gloo ranks (2 training at TP2, 2 engine ranks
with reference engines), the tiny model.

A run SIGKILLed right after its step-2 checkpoint appeared, then relaunched with train.resume=auto, logs the same
metrics for steps 1-4 as an uninterrupted run, exactly, except wall-clock times (as the colocated
tests/trainer/test_loop_torchrun.py): the training ranks restored model, optimizer, schedule and RNG from the dist
checkpoint, every rank restored the sampler, and the engines got the restored weights by the first sync. one_step and
stream are not compared this way: after a restart one_step generates the pending step's prompts again with the
restored weights (not the previous step's), and where stream's updates in place land depends on timing; their
kill -9 at random moments, counted prompt by prompt, is tests/trainer/test_async_restart.py (slow, both placements).
"""
from __future__ import annotations

from loop_harness import base_overrides, launch, launch_and_kill_after, metrics, without_time
from test_async_one_step import tiny_hf  # noqa: F401  (fixture)
from test_separate_placement import SEPARATE

STEPS = 4


def _overrides(tiny_hf, run, **extra):  # noqa: F811
    return base_overrides(tiny_hf, run, **{**SEPARATE, "train.steps": STEPS, "train.save_interval": 2, **extra})


def test_separate_resume_after_sigkill_is_exact(tiny_hf, tmp_path):  # noqa: F811
    extra = {"rollout.async": "off"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    launch(_overrides(tiny_hf, ref, **extra), tmp_path, timeout=420, nproc=4)
    assert (ref / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert not list((ref / "checkpoints" / "step_2").glob("rng_rank[23].pt"))  # engine ranks hold no model state
    launch_and_kill_after(_overrides(tiny_hf, run, **extra), tmp_path, run / "checkpoints" / "step_2" / "COMPLETE",
                          timeout=420, nproc=4)
    assert not (run / "checkpoints" / "step_4").exists()
    p = launch(_overrides(tiny_hf, run, **extra), tmp_path, timeout=420, nproc=4)
    assert "at step 2" in p.stdout
    a, b = metrics(run), metrics(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert without_time(x) == without_time(y), f"step {x['step']} differs"
