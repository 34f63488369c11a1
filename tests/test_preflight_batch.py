"""A rollout batch no host can hold (rollout.prompts_per_step=10**9): one line before any work, on every rank count.
Before, the run built its models, then the sampler filled memory for minutes (a MemoryError traceback under a memory
limit, the OOM killer without one). A batch larger than the data set stays legitimate: it goes on into the next
epoch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config
from mtrain.preflight import preflight
from mtrain.rollout.protocol import MIN_COMPLETION_HOST_BYTES, Completion
from mtrain.tiny_hf import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
HUGE = 10 ** 9


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_tiny_hf("llama", tmp_path_factory.mktemp("batch") / "llama")


def cfg_for(hf: Path, tmp_path: Path, *overrides: str):
    return load_config(CONFIG, [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", *overrides])


def test_the_floor_is_below_what_one_completion_takes():
    c = Completion(rid="s-0-0-", prompt_ids=[5], output_ids=[7], logprobs=[-1.5], finish_reason="stop",
                   weight_version=0)
    # not vars(c): the field dict's size depends on the instance layout Python chose (479 bytes in all in a long
    # process where a fresh one gave 607)
    own = sum(sys.getsizeof(x) for x in (c, c.prompt_ids, c.output_ids, c.logprobs, c.rid, c.logprobs[0]))
    assert own >= MIN_COMPLETION_HOST_BYTES, own


def test_a_batch_no_host_can_hold_is_one_line(hf, tmp_path):
    with pytest.raises(ConfigError) as e:
        preflight(cfg_for(hf, tmp_path, f"rollout.prompts_per_step={HUGE}"), world=1)
    msg = str(e.value)
    assert msg.startswith(f"rollout.prompts_per_step: {HUGE} x rollout.samples_per_prompt=4: {4 * HUGE} samples per "
                          "step hold at least ") and msg.endswith("lower rollout.prompts_per_step"), msg
    assert "\n" not in msg
    # partial rollout keeps over_sample x the groups in flight
    with pytest.raises(ConfigError, match=r"with rollout\.over_sample=2\.0 hold at least"):
        preflight(cfg_for(hf, tmp_path, f"rollout.prompts_per_step={HUGE // 4}", "rollout.partial=true"), world=1)


def test_a_batch_larger_than_the_data_set_is_not_refused(hf, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(3)))
    cfg = cfg_for(hf, tmp_path, f"data.train_path={data}", "rollout.prompts_per_step=64")
    assert preflight(cfg, world=1)["model_type"] == "llama"


@pytest.mark.parametrize("nproc", [None, 2])
def test_the_command_says_it_in_one_line_on_every_rank_count(hf, tmp_path, nproc):
    cmd = [sys.executable, "-m", "mtrain", "train", *(["--nproc-per-node", str(nproc)] if nproc else []), str(CONFIG),
           f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}", f"rollout.prompts_per_step={HUGE}",
           *(["parallel.tp=2"] if nproc else [])]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("mtrain: error:")]
    assert len(lines) == 1 and lines[0].startswith("mtrain: error: ConfigError: rollout.prompts_per_step: "), p.stderr
    assert not (tmp_path / "run").exists()
