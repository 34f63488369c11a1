"""train.keep_checkpoints: after each save only the newest N complete checkpoints stay (the end-to-end case, a 3-step
run keeping 2, is in tests/test_model_folder_and_launch.py)."""
from __future__ import annotations

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.trainer.checkpoint import prune_checkpoints


def _ckpt(root, name, complete=True):
    (root / name / "mcore").mkdir(parents=True)
    if complete:
        (root / name / "COMPLETE").write_text(name)


def test_keeps_the_newest_complete_ones(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 10, 3):
        _ckpt(root, f"step_{s}")
    _ckpt(root, "step_11", complete=False)  # a save that never finished: not counted, not touched
    _ckpt(root, ".partial_step_12", complete=False)
    removed = prune_checkpoints(root, 2)
    assert sorted(p.name for p in removed) == ["step_1", "step_2"]  # numeric order: step_10 is newer than step_3
    assert sorted(p.name for p in root.iterdir()) == [".partial_step_12", "step_10", "step_11", "step_3"]
    assert prune_checkpoints(root, None) == [] and len(list(root.glob("step_*"))) == 3


def test_key_default_and_bounds():
    assert load_config(None, ["model.hf_path=x", "data.task=arithmetic"]).train.keep_checkpoints == 2
    assert load_config(None, ["model.hf_path=x", "data.task=arithmetic",
                              "train.keep_checkpoints=null"]).train.keep_checkpoints is None
    with pytest.raises(ConfigError, match=r"^train\.keep_checkpoints: must be >= 1"):
        load_config(None, ["model.hf_path=x", "data.task=arithmetic", "train.keep_checkpoints=0"])
