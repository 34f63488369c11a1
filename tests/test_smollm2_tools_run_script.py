"""examples/smollm2_tools/run.sh: the calculator demo through `mtrain train` (Megatron-core, multi-turn tool
rollouts). The script runs for real on a tiny random Llama (HF_DIR) for one step with an eval before and after, so
the config, the data files, the trainer's multi-turn eval metrics and summarize.py are exercised on the path the
real demo takes; the data files are checked to be make_data.py's output (the task declared once).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_smollm2_run_script import script_env

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "smollm2_tools"
# One step of 2 x 2 trajectories; the character tokenizer of the tiny model makes the worked-example prompt long.
TINY = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.micro_batch_size=2",
        "rollout.max_new_tokens=4", "multi_turn.max_total_tokens=1500"]


def test_committed_data_and_system_prompt_are_the_tasks(tmp_path):
    p = subprocess.run([sys.executable, str(DEMO / "make_data.py"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (DEMO / "data" / name).read_text()
    train = {tuple(json.loads(line)["pair"]) for line in (DEMO / "data" / "train.jsonl").read_text().splitlines()}
    held_out = {tuple(json.loads(line)["pair"]) for line in (DEMO / "data" / "eval.jsonl").read_text().splitlines()}
    assert len(train) == 48 and len(held_out) == 32 and not train & held_out
    sys.path.insert(0, str(DEMO))
    try:
        from calculator_task import SYSTEM
    finally:
        sys.path.remove(str(DEMO))
    from mtrain.config import load_config
    cfg = load_config(DEMO / "config.yaml", [f"model.hf_path={tmp_path}"])  # validated, not read
    assert cfg.multi_turn.system_prompt == SYSTEM and cfg.multi_turn.rollout_fn


def test_run_trains_one_step_and_summarizes_the_multi_turn_evals(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf", overrides={"max_position_embeddings": 2048})
    run = tmp_path / "run"
    evals = tmp_path / "eval.jsonl"  # the first 4 held-out problems: the eval runs twice
    evals.write_text("".join((DEMO / "data" / "eval.jsonl").read_text().splitlines(keepends=True)[:4]))
    p = subprocess.run(["bash", str(DEMO / "run.sh"), *TINY, f"data.eval_path={evals}"], cwd=tmp_path, capture_output=True, text=True,
                       env=script_env(tmp_path, HF_DIR=str(hf), RUN_DIR=str(run), NPROC="1", PYTHON=sys.executable),
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [0, 1]  # val_before_train, and the last step
    for e in summary["evals"]:  # the trainer's eval reports the multi-turn tool metrics next to the accuracy
        assert 0.0 <= e["accuracy"] <= 1.0 and 0.0 <= e["tool_call_rate"] <= 1.0 and e["drift_tokens"] is not None
        assert e["valid_call_rate"] is not None
    step = summary["train_per_step"][0]
    assert step["logprob_diff_max_abs"] <= 2e-5 and step["model_tokens"] > 0
    assert summary["eval_prompts"] == 4 and summary["samples_per_step"] == 4
    assert (run / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 1}
