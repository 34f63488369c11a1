"""train.log_wandb: W&B offline runs (no network) read back from the run's own .wandb file: the metrics.jsonl records
under the same names and steps, the resolved config, eval samples as a table; one rank logs under torchrun; one line
when wandb is missing (and when math-verify is, for its reward)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from mtrain.metrics import MetricsWriter, read_metrics  # noqa: E402
from mtrain.wandb_log import WandbSink  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


def read_wandb_records(path: Path) -> list:
    """The records of a .wandb file: its header, then LevelDB-log blocks of 32 KiB (7-byte record headers: crc, length,
    type full/first/middle/last), each record one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, buf = 7, [], b""
    while pos + 7 <= len(data):
        space = 32768 - pos % 32768
        if space < 7:
            pos += space
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:
            pos += space - 7
            continue
        chunk, pos = data[pos:pos + n], pos + n
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind in (3, 4):
            buf += chunk
            if kind == 4:
                chunks.append(buf)
    records = []
    for raw in chunks:
        r = pb.Record()
        r.ParseFromString(raw)
        records.append(r)
    return records


def offline_run(run_dir: Path, wait_s: float = 60.0) -> dict:
    runs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    # wandb's service process writes the file: run.finish() may return before it has (seen: only the 7-byte header
    # just after finish, the whole run a moment later). Its last record is "exit" once it is complete.
    deadline = time.monotonic() + wait_s
    while True:
        records = read_wandb_records(runs[0])
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {"history": {}, "config": {}, "run": None, "dir": runs[0].parent}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out["history"].setdefault(int(row["_step"]), {}).update(row)
        elif kind == "run":
            out["run"] = r.run
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
    return out


def same_records(metrics_records: list[dict], history: dict) -> None:
    """Every metrics.jsonl value is in the W&B history at its step under its name."""
    assert metrics_records
    for rec in metrics_records:
        row = history[rec["step"]]
        for k, v in rec.items():
            if k != "step" and v is not None:
                assert row[k] == pytest.approx(v), (rec["step"], k)


@pytest.fixture
def wandb_service_closed():
    """wandb starts a service process for the pytest process; ended here, not by wandb's atexit hook, which found it
    gone after the rest of the suite (later tests end their process groups) and printed a traceback at exit."""
    yield
    import wandb
    wandb.teardown()


def test_metrics_writer_sink_offline(tmp_path, monkeypatch, wandb_service_closed):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, {"train": {"steps": 3}, "model": {"hf_path": "/m"}}, project="proj", name="r1",
                     tags=["a", "b"])
    with MetricsWriter(tmp_path, progress=False, tensorboard=False, sinks=(sink,)) as m:
        m.log(0, {"eval/reward_mean": 0.25})
        for s in (1, 2):
            m.log(s, {"reward/mean": 0.5 * s, "kl/mean": 0.01, "note": "text", "missing": None})
        m.log_table(2, "eval/samples", [{"step": 2, "response": "\\boxed{3}", "reward": 1.0}])
    run = offline_run(tmp_path)
    same_records(read_metrics(tmp_path), run["history"])
    assert run["run"].project == "proj" and run["run"].display_name == "r1" and list(run["run"].tags) == ["a", "b"]
    assert run["config"]["train"] == {"steps": 3} and run["config"]["model"] == {"hf_path": "/m"}
    assert run["history"][2]["eval/samples/_type"] == "table-file"  # a table's fields: nested keys under its name
    table = json.loads((run["dir"] / "files" / run["history"][2]["eval/samples/path"]).read_text())
    assert table["columns"] == ["step", "response", "reward"] and table["data"] == [[2, "\\boxed{3}", 1.0]]


def test_missing_wandb_is_one_line(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "llama")
    # wandb hidden the way an install without it looks to importlib (find_spec answers None)
    code = ("import sys; sys.modules['wandb'] = None; from mtrain.__main__ import main; sys.argv = sys.argv[1:]; "
            "sys.exit(main())")
    p = subprocess.run([sys.executable, "-c", code, "mtrain", "train", str(CONFIG), f"model.hf_path={hf}",
                        f"train.run_dir={tmp_path / 'run'}", "train.log_wandb=true"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "mtrain: error: ConfigError: train.log_wandb: true, but wandb is not installed: pip install 'mtrain[wandb]'"]


def test_torchrun_two_ranks_logs_once_with_the_jsonl_names(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "llama", seed=0)
    run_dir = tmp_path / "run"
    over = {"model.hf_path": hf, "train.run_dir": run_dir, "reward.fn": "mtrain.data.rewards:digit_share_reward",
            "train.steps": 2, "train.save_interval": -1, "train.eval_interval": 2, "train.val_before_train": "true",
            "parallel.tp": 2, "train.log_wandb": "true", "train.wandb.project": "mtrain-test",
            "train.wandb.name": "tiny", "train.wandb.tags": "ci,tiny", "train.wandb.mode": "offline"}
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO), WANDB_SILENT="true")
    env.pop("WANDB_MODE", None)  # the config's mode is what makes this run offline
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "mtrain", "train", str(CONFIG), *[f"{k}={v}" for k, v in over.items()]],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    run = offline_run(run_dir)  # exactly one W&B run: rank 1 logs nothing
    records = read_metrics(run_dir)
    assert sorted({r["step"] for r in records}) == [0, 1, 2]
    same_records(records, run["history"])
    assert run["run"].display_name == "tiny" and list(run["run"].tags) == ["ci", "tiny"]
    assert run["config"]["train"]["steps"] == 2 and run["config"]["model"]["hf_path"] == str(hf)  # resolved config
    samples = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    for step in (0, 2):
        table = json.loads((run["dir"] / "files" / run["history"][step]["eval/samples/path"]).read_text())
        want = [s for s in samples if s["step"] == step]
        assert [dict(zip(table["columns"], row)) for row in table["data"]] == want


def test_missing_math_verify_is_one_line(tmp_path):
    from mtrain.tiny_hf import write_tiny_hf
    hf = write_tiny_hf("llama", tmp_path / "llama")
    code = ("import sys; sys.modules['math_verify'] = None; from mtrain.__main__ import main; sys.argv = sys.argv[1:]; "
            "sys.exit(main())")
    p = subprocess.run([sys.executable, "-c", code, "mtrain", "train", str(CONFIG), f"model.hf_path={hf}",
                        f"train.run_dir={tmp_path / 'run'}", "reward.fn=mtrain.data.rewards:math_verify_reward"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "mtrain: error: ConfigError: reward.fn: mtrain.data.rewards:math_verify_reward needs math-verify, which is not "
        "installed: pip install 'mtrain[math]'"]
