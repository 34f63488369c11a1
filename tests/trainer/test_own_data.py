"""Training on your own prompts takes one override (issue 19, point 13): `data.train_path=FILE` on a config that
uses a generated task. The repository's example JSONL trains for real; a broken file is one line before any work."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loop_harness import CONFIG, REPO, env

EXAMPLE = REPO / "examples" / "data" / "unit_conversion_train.jsonl"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama", seed=0)


def train(tmp_path, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mtrain", "train", str(CONFIG), *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)


def test_one_override_trains_on_the_example_jsonl(tiny_llama, tmp_path):
    run = tmp_path / "run"
    p = train(tmp_path, f"model.hf_path={tiny_llama}", f"train.run_dir={run}", "train.steps=1",
              f"data.train_path={EXAMPLE}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data.train_path replaces the config file's data.task='arithmetic'" in p.stderr
    assert "evaluation (train.eval_interval from the file) is off" in p.stderr
    prompts = {json.loads(line)["prompt"] for line in EXAMPLE.read_text().splitlines()}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1] and "reward/mean" in recs[0]
    assert prompts and "task arithmetic" not in p.stdout and str(EXAMPLE) in p.stdout  # the summary names the file


def test_the_launcher_prints_the_data_notes_once(tiny_llama, tmp_path):
    # `mtrain train --nproc-per-node 2`: the launcher checks the config and prints its notes; rank 0 loads the
    # same config again and printed them a second time
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mtrain", "train", "--nproc-per-node", "2", str(CONFIG), f"model.hf_path={tiny_llama}",
           f"train.run_dir={run}", "train.steps=1", f"data.train_path={EXAMPLE}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("mtrain: note: data.train_path replaces the config file's data.task") == 1, p.stderr
    assert p.stderr.count("mtrain: note: no data.eval_path") == 1, p.stderr


def test_a_broken_prompt_file_is_one_line_before_any_work(tiny_llama, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+2?", "answer": "4"}\n{"question": "no prompt key"}\n')
    p = train(tmp_path, f"model.hf_path={tiny_llama}", f"train.run_dir={tmp_path / 'run'}", f"data.train_path={bad}")
    assert p.returncode == 2
    errors = [x for x in p.stderr.splitlines() if x.startswith("mtrain: error")]
    assert len(errors) == 1 and "data.train_path:" in errors[0] and "bad.jsonl" in errors[0], p.stderr
    assert not (tmp_path / "run").exists()
