"""A config error under torchrun, launched as users launch it: the one `mtrain: error:` line must reach the terminal.

torchrun stops every rank as soon as one exits; a line printed by rank 0 alone was lost whenever another rank exited
first (torchrun's `ChildFailedError` report only, 3 of 3 tries with 2 ranks). Each rank now prints the line itself.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"
LINE = "mtrain: error: ConfigError: model.hf_path: /does/not/exist is not a HF model dir (no config.json)"


@pytest.mark.parametrize("nproc", [1, 2])
def test_config_error_line_under_torchrun(tmp_path, nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        "-m", "mtrain", "train", str(CONFIG), "model.hf_path=/does/not/exist"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    lines = [x for x in out.splitlines() if x.startswith("mtrain: error")]
    assert lines and all(x == LINE for x in lines), out  # whole lines: none garbled by another rank's
    assert 1 <= len(lines) <= nproc, out
    # torchrun prints its own traceback of its launcher; none may come from mtrain's code
    assert not re.search(r'File ".*mtrain[/\\]', out), out
    assert not (tmp_path / "runs").exists()
