"""`mtrain serve` refuses, in one line before anything starts, an empty API key (it would turn authentication off
while the banner names serve.api_key as the key's source) and timeouts that are infinite, NaN or beyond an hour
(.inf read timeout: a traceback at start; .inf shutdown grace: the drain skipped)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.config import ConfigError, load_config

REPO = str(Path(__file__).resolve().parents[2])
BASE = ["model.hf_path=x", "data.task=arithmetic"]


@pytest.mark.parametrize("override,message", [
    ("serve.read_timeout_s=.inf", "serve.read_timeout_s: must be > 0 and <= 3600 seconds, got inf"),
    ("serve.read_timeout_s=.nan", "serve.read_timeout_s: must be > 0 and <= 3600 seconds, got nan"),
    ("serve.shutdown_grace_s=.inf", "serve.shutdown_grace_s: must be >= 0 and <= 3600 seconds, got inf"),
    ("serve.shutdown_grace_s=-1", "serve.shutdown_grace_s: must be >= 0"),
    ("serve.session_ttl_s=.inf", "serve.session_ttl_s: must be > 0 and <= 2592000 seconds (or null: never)"),
])
def test_unbounded_serve_timeouts_are_one_config_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [override])
    assert message in str(e.value)
    load_config(None, BASE + ["serve.shutdown_grace_s=0", "serve.session_ttl_s=null", "serve.read_timeout_s=3600"])


@pytest.mark.parametrize("key", ['""', '"   "'])
def test_an_empty_api_key_in_the_config_file_stops_mtrain_serve_in_one_line(tmp_path, key):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model:\n  hf_path: /nonexistent\ndata:\n  task: arithmetic\nserve:\n  api_key: {key}\n")
    p = subprocess.run([sys.executable, "-m", "mtrain", "serve", str(cfg)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "serve.api_key: must not be empty (an empty key would turn authentication off)" in p.stderr, p.stderr


def test_an_infinite_read_timeout_stops_mtrain_serve_in_one_line(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model:\n  hf_path: /nonexistent\ndata:\n  task: arithmetic\n")
    p = subprocess.run([sys.executable, "-m", "mtrain", "serve", str(cfg), "serve.read_timeout_s=.inf"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "serve.read_timeout_s: must be > 0 and <= 3600 seconds, got inf" in p.stderr, p.stderr
