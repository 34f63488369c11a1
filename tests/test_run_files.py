"""train.resume=never in a run dir with checkpoints sets the earlier run aside (mtrain/trainer/run_dir.py).

The files here are stand-ins (a checkpoint's names, not its tensors); the real run, then a never run, then an auto
resume is tests/trainer/test_loop_torchrun.py::test_never_sets_the_earlier_run_aside.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.preflight import check_resume
from mtrain.run_files import PREVIOUS
from mtrain.trainer.run_dir import earlier_outputs, moved_config_path, set_aside
from mtrain.trainer.checkpoint import find_latest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
NOW = datetime(2026, 12, 8, 10, 15, 0, tzinfo=timezone.utc)


def earlier_run(run: Path) -> dict[str, bytes]:
    """A run dir as a 2-step run leaves it, plus a file of the user's; {relative path: bytes} of the run's outputs."""
    files = {"checkpoints/step_1/COMPLETE": b"1", "checkpoints/step_2/COMPLETE": b"2", "checkpoints/latest": b"step_2",
             "metrics.jsonl": b'{"step": 1}\n{"step": 2}\n', "config.yaml": b"train: {}\n",
             "train_samples.jsonl": b"{}\n", "tensorboard/events.out": b"tb", "wandb_run_id": b"abcd1234\n"}
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
