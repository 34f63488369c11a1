"""examples/smollm2/run.sh writes a run's results into the run directory, never into tracked docs/ (issue 19,
point 11); update_docs.sh is the one explicit way to replace the committed figures.

The script runs for real, with its documented HF_DIR / RUN_DIR / NPROC knobs pointing at a tiny random Llama and a
scratch directory, and overrides that make the demo's 28 steps one short step with an eval before it.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACKED = [REPO / "docs" / "smollm2_demo.json", REPO / "docs" / "smollm2_demo.png"]
TINY = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.micro_batch_size=2",
        "data.arithmetic.num_eval=2", "train.eval_interval=0", "rollout.max_new_tokens=4", "rollout.max_prompt_len=200",
        "data.system_prompt=null"]


def digest(paths) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def script_env(tmp_path: Path, **extra) -> dict[str, str]:
    from test_readme_commands import scripts_dir  # this interpreter's python, mtrain and torchrun first on PATH
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PATH"] = f"{scripts_dir(tmp_path)}{os.pathsep}{env['PATH']}"
    env.pop("PYTHONPATH", None)
    return env


def test_run_writes_to_the_run_dir_and_docs_change_only_on_request(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf")
    run = tmp_path / "run"
    before = digest(TRACKED)
    p = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "run.sh"), *TINY], cwd=tmp_path,
                       env=script_env(tmp_path, HF_DIR=str(hf), RUN_DIR=str(run), NPROC="1"), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert digest(TRACKED) == before  # the user's run left the committed figures alone
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["eval_curve"][0]["step"] == 0
    # the run says what ran it, from its own config and machine (the same script sums up GPU runs)
    assert "CPU reference engine" in summary["what"] and "no GPU" in summary["machine"]
    assert (run / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "update_docs.sh" in p.stdout
    assert "accuracy_after: " in p.stdout and "eval_curve" not in p.stdout  # single figures on screen, curves in the JSON
    # The explicit command refuses a directory without results, and changes nothing then.
    bad = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "update_docs.sh"), str(tmp_path / "hf")],
                         env=script_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "summary.json missing" in bad.stderr
    assert digest(TRACKED) == before
    # The demo's train.resume=never sets the summary aside with the run it sums up (it stayed behind, to be taken for
    # the next run's).
    from mtrain.trainer.run_dir import set_aside
    written = {name: (run / name).read_bytes() for name in ("summary.json", "summary.png")}
    assert set_aside(run) is not None
    (moved,) = (run / "previous").iterdir()
    assert {name: (moved / name).read_bytes() for name in written} == written
    assert not any((run / name).exists() for name in written)


@pytest.mark.slow  # a second torchrun of the script (~60 s); the LoRA loop itself is in tests/trainer/test_loop_lora.py
def test_lora_overrides_file_runs_the_demo_with_adapters(tmp_path):
    """OVERRIDES=examples/smollm2/lora.overrides: the same script trains rank-32 adapters (base frozen) and syncs
    them by name; a missing file is one error line before anything runs."""
    import yaml

    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "hf")
    run = tmp_path / "run"
    env = script_env(tmp_path, HF_DIR=str(hf), RUN_DIR=str(run), NPROC="1",
                     OVERRIDES="examples/smollm2/lora.overrides")
    p = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "run.sh"), *TINY], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    lora = yaml.safe_load((run / "config.yaml").read_text())["model"]["lora"]
    assert lora["rank"] == 32 and lora["targets"] == ["qkv", "o_proj", "gate_up", "down"] and lora["lr"] == 5e-5
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step = [r for r in recs if "sync/adapters_only" in r]
    assert step and step[0]["sync/adapters_only"] == 1.0 and step[0]["sync/bytes"] > 0
    bad = subprocess.run(["bash", str(REPO / "examples" / "smollm2" / "run.sh")], cwd=tmp_path,
                         env={**env, "OVERRIDES": "no/such.overrides"}, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "run.sh: error: OVERRIDES=no/such.overrides: no such file" in bad.stderr
