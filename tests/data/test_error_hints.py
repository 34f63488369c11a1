"""Errors about your own data and reward name the setting that fixes them (issue 46, point 3)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtrain.data.datasets import load_prompts
from mtrain.data.records import DatasetError
from mtrain.data.rewards import RewardError, load_reward_fn

REPO = Path(__file__).resolve().parents[2]


def test_missing_prompt_key_names_data_prompt_key(tmp_path):
    f = tmp_path / "gsm.jsonl"
    f.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    with pytest.raises(DatasetError, match=r"missing key 'prompt' .*; name the field with data\.prompt_key=question$"):
        load_prompts(f)


def test_missing_answer_key_names_data_answer_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "2+2?", "solution": "4"}) + "\n")
    with pytest.raises(DatasetError, match=r"name the field with data\.answer_key=solution$"):
        load_prompts(f)


def test_reward_file_without_function_shows_the_form(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, answer):\n    return 0.0\n")
    with pytest.raises(RewardError, match=rf"'path/to/file.py:function' \(here: '{f}:FUNCTION'\)"):
        load_reward_fn(str(f))
    assert load_reward_fn(f"{f}:score")("x", 1) == 0.0


def test_reward_module_path_that_is_a_file_names_the_file_form(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text("def score(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"a file is named by its path: 'rewards/mine\.py:score'$"):
        load_reward_fn("rewards/mine:score")


def test_preflight_refuses_a_bad_reward_fn_before_any_model_is_built(tmp_path):
    from mtrain.config import ConfigError, load_config
    from mtrain.preflight import preflight
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf")
    cfg = load_config(REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml",
                      [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", "reward.fn=no_such_module:score"])
    with pytest.raises(ConfigError, match=r"^reward\.fn: reward function 'no_such_module:score': cannot import"):
        preflight(cfg, world=1)
