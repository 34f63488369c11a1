"""Secrets never reach a config dump, a log or a tracker: `serve.api_key` given in the config file is absent from
RUN_DIR/config.yaml, the printed config and the config W&B receives (an offline run, read back from its files);
the run folder is owner-only (sandboxed tool code runs as another uid on the same host)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from mtrain.config import load_config

KEY = "sk-test-4f9d2c7be1a04e55a8"


def _config(tmp_path: Path):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": {"hf_path": "x"}, "data": {"task": "arithmetic"},
                                 "serve": {"api_key": KEY}}))
    cfg = load_config(f)
    assert cfg.serve.api_key == KEY  # the running code still has it
    return cfg


def test_config_dump_and_printed_config_leave_the_key_out(tmp_path):
    cfg = _config(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    out = cfg.dump_yaml(run_dir / "config.yaml")
    assert KEY not in out.read_text() and KEY not in cfg.format_config() and KEY not in str(cfg.to_dict())
    assert "serve.api_key: set, not written here" in out.read_text()
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700  # was 0755: any uid read config.yaml
    back = load_config(out)
    assert back.serve.api_key is None and back.serve.api_key_env == "MTRAIN_API_KEY"


def test_wandb_gets_the_config_without_the_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from mtrain.wandb_log import WandbSink
    cfg = _config(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "run").mkdir()
    sink = WandbSink(tmp_path / "run", cfg.to_dict(), project="p", mode="offline")
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert not [p for p in files if KEY.encode() in p.read_bytes()]


@pytest.mark.parametrize("value", [[KEY], {"k": KEY}, {KEY: 1}, True])
def test_a_secret_of_the_wrong_type_is_refused_without_showing_it(tmp_path, value):
    from mtrain.config import ConfigError
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": {"hf_path": "x"}, "data": {"task": "arithmetic"},
                                 "serve": {"api_key": value}}))
    with pytest.raises(ConfigError, match=r"serve.api_key: expected .*not shown: serve.api_key is a secret") as e:
        load_config(f)
    assert KEY not in str(e.value)
