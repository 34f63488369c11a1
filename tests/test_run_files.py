"""What a start sets aside in its run dir (mtrain/trainer/run_dir.py): train.resume=never, or a checkpoint of another
run dir, the earlier run whole; a checkpoint of the run dir at step k with later ones beside it, the steps after k.

The files here are stand-ins (a checkpoint's names, not its tensors); the real runs are
tests/trainer/test_loop_torchrun.py::test_never_sets_the_earlier_run_aside and
::test_resume_from_an_earlier_step_sets_the_later_steps_aside.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.preflight import check_resume
from mtrain.run_files import PREVIOUS, SUMMARY_FILE, SUMMARY_PLOT
from mtrain.trainer.run_dir import earlier_outputs, moved_config_path, set_aside
from mtrain.trainer.checkpoint import find_latest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
NOW = datetime(2026, 12, 8, 10, 15, 0, tzinfo=timezone.utc)


def earlier_run(run: Path) -> dict[str, bytes]:
    """A run dir as a 2-step run leaves it, plus a file of the user's; {relative path: bytes} of the run's outputs."""
    files = {"checkpoints/step_1/COMPLETE": b"1", "checkpoints/step_2/COMPLETE": b"2", "checkpoints/latest": b"step_2",
             "metrics.jsonl": b'{"step": 1}\n{"step": 2}\n', "config.yaml": b"train: {}\n",
             "train_samples.jsonl": b"{}\n", "tensorboard/events.out": b"tb", "wandb_run_id": b"abcd1234\n",
             SUMMARY_FILE: b"{}\n", SUMMARY_PLOT: b"png", "metrics.png": b"png"}  # the examples' summary, the plot
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    (run / "notes.txt").write_text("mine")
    return files


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_earlier_run_moves_whole_into_one_folder_and_auto_does_not_look_there(tmp_path):
    run = tmp_path / "run"
    files = earlier_run(run)
    line = set_aside(run, now=NOW)
    dest = run / PREVIOUS / "20261208T101500Z"
    assert tree(dest) == files
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", PREVIOUS]  # the user's own file stays
    assert "\n" not in line and str(dest) in line and f"rm -r {dest}" in line and f"train.run_dir={dest}" in line
    assert find_latest(run, report=None) is None  # resume=auto: nothing to resume in run_dir itself
    assert find_latest(dest, report=None) is None  # (stand-ins: not intact checkpoints, so not picked either way)
    assert earlier_outputs(run) == [] and set_aside(run, now=NOW) is None  # nothing left to move


def test_a_second_start_in_the_same_second_gets_its_own_folder(tmp_path):
    run = tmp_path / "run"
    earlier_run(run)
    set_aside(run, now=NOW)
    files = earlier_run(run)
    set_aside(run, now=NOW)
    assert sorted(p.name for p in (run / PREVIOUS).iterdir()) == ["20261208T101500Z", "20261208T101500Z-1"]
    assert tree(run / PREVIOUS / "20261208T101500Z-1") == files


def test_a_run_dir_without_checkpoints_starts_in_place(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert set_aside(run, now=NOW) is None and not (run / PREVIOUS).exists()
    assert set_aside(tmp_path / "absent", now=NOW) is None


def cfg(run: Path, *overrides: str):
    return load_config(CONFIG, [f"train.run_dir={run}", *overrides])


def test_a_configured_path_inside_what_moves_is_one_line(tmp_path):
    run = tmp_path / "run"
    earlier_run(run)
    inside = run / "checkpoints" / "step_2" / "mcore"
    with pytest.raises(ConfigError) as e:
        check_resume(cfg(run, "train.resume=never", f"model.mcore_ckpt={inside}"))
    message = str(e.value)
    assert message.startswith(f"model.mcore_ckpt: {inside} lies in {run / 'checkpoints'}") and "\n" not in message
    assert "another train.run_dir" in message
    assert moved_config_path(cfg(run, f"model.mcore_ckpt={inside}")) is None  # auto moves nothing
    assert moved_config_path(cfg(run, "train.resume=never", f"reward.fn={run / 'notes.txt'}:f")) is None
    with pytest.raises(ConfigError, match="^reward.fn: "):
        check_resume(cfg(run, "train.resume=never", f"reward.fn={run / 'checkpoints' / 'r.py'}:f"))


def rows(*steps, **extra) -> bytes:
    return b"".join(json.dumps({"step": s, **extra}).encode() + b"\n" for s in steps)


def branched_run(run: Path) -> dict[str, bytes]:
    """A run dir whose run went to step 4 (and died saving step 5), plus a file of the user's."""
    files = {f"checkpoints/step_{s}/COMPLETE": str(s).encode() for s in (1, 2, 3, 4)}
    files.update({"checkpoints/.partial_step_5/mcore/x": b"half", "checkpoints/latest": b"step_4",
                  "metrics.jsonl": rows(0, 1, 2, 3, 4) + b'{"step": 5, "rew', "train_samples.jsonl": rows(1, 2, 3, 4),
                  "eval_samples.jsonl": rows(0, 2, 4, answer="\u00e9"), "trained_prompts.jsonl": rows(1, 2, 3, 4, 5),
                  "config.yaml": b"train: {}\n", SUMMARY_FILE: b"{}\n", "wandb_run_id": b"abcd1234\n",
                  "tensorboard/events.out": b"tb", "notes.txt": b"mine"})
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    return files


def test_a_resume_from_an_earlier_step_sets_the_later_steps_aside(tmp_path):
    """train.resume=RUN_DIR/checkpoints/step_2 while step_4 exists: steps 3 and 4 (checkpoints, rows, the files about
    the run as a whole) move to previous/<time>/; the run dir keeps steps <= 2, and every byte is in one of the two."""
    run = tmp_path / "run"
    before = branched_run(run)
    step_2 = run / "checkpoints" / "step_2"
    line = set_aside(run, str(step_2), step_2, 2, now=NOW)
    dest = run / PREVIOUS / "20261208T101500Z"
    assert sorted(p.name for p in (dest / "checkpoints").iterdir()) == [".partial_step_5", "step_3", "step_4"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert (run / "checkpoints" / "latest").read_text() == "step_2"  # named step_4, now moved
    for name, data in before.items():
        if name.endswith(".jsonl"):  # each row in one of the two files, in order: the later ones (and a torn one) moved
            here, there = (run / name).read_bytes(), (dest / name).read_bytes() if (dest / name).exists() else b""
            assert (here + there).rstrip(b"\n") == data.rstrip(b"\n") and all(
                json.loads(x)["step"] <= 2 for x in here.splitlines()), name
    assert (run / "eval_samples.jsonl").read_bytes() == rows(0, 2, answer="\u00e9")
    for name in ("config.yaml", SUMMARY_FILE, "wandb_run_id"):  # W&B: the steps after 2 go to a new W&B run
        assert (dest / name).read_bytes() == before[name] and not (run / name).exists()
    assert (run / "tensorboard" / "events.out").exists() and (run / "notes.txt").exists()  # purge_step hides TB's
    assert "\n" not in line and line.startswith(f"train.resume={step_2}: this run dir's steps after 2 (")
    assert "checkpoints/step_3, checkpoints/step_4" in line and "metrics.jsonl" in line and f"rm -r {dest}" in line
    assert f"train.resume={dest / 'checkpoints' / 'step_4'}" in line
    assert set_aside(run, str(step_2), step_2, 2, now=NOW) is None  # nothing after step 2 any more


def test_nothing_moves_without_a_later_checkpoint(tmp_path):
    run = tmp_path / "run"
    branched_run(run)
    step_4 = run / "checkpoints" / "step_4"
    assert set_aside(run, str(step_4), step_4, 4, now=NOW) is None  # the newest (an unfinished save 5 is its own)
    assert set_aside(run, "auto", step_4, 4, now=NOW) is None  # auto: the steps after 4 run again, as before
    assert not (run / PREVIOUS).exists() and (run / "metrics.jsonl").read_bytes().count(b"\n") == 5


def test_a_checkpoint_of_another_run_dir_sets_this_run_aside_and_leaves_the_other_alone(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    mine, theirs = branched_run(run), branched_run(other)
    step_2 = other / "checkpoints" / "step_2"
    line = set_aside(run, str(step_2), step_2, 2, now=NOW)
    assert tree(other) == theirs
    assert tree(run / PREVIOUS / "20261208T101500Z") == {k: v for k, v in mine.items() if k != "notes.txt"}
    assert line.startswith(f"train.resume={step_2} (another run dir's): the earlier run's checkpoints, ")
    assert set_aside(tmp_path / "new", str(step_2), step_2, 2, now=NOW) is None  # an empty run dir: nothing to move


def test_a_configured_path_inside_a_later_step_is_one_line(tmp_path):
    run = tmp_path / "run"
    branched_run(run)
    step_2 = run / "checkpoints" / "step_2"
    inside = run / "checkpoints" / "step_4" / "mcore"
    message = moved_config_path(cfg(run, f"train.resume={step_2}", f"model.mcore_ckpt={inside}"))
    assert message.startswith(f"model.mcore_ckpt: {inside} lies in {run / 'checkpoints' / 'step_4'}, which "
                              f"train.resume={step_2} moves to {run / PREVIOUS}/") and "\n" not in message
    assert moved_config_path(cfg(run, f"train.resume={step_2}", f"model.mcore_ckpt={step_2 / 'mcore'}")) is None
