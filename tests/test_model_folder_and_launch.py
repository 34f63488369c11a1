"""What a new user meets first, launched as users launch: `mtrain train --nproc-per-node N CONFIG key=value ...`.

* a model folder without tokenizer files is refused in one line (it used to train through the character tokenizer
  and answer noise, exit 0);
* a hub id (`ORG/NAME`) for model.hf_path is read from huggingface_hub's cache, laid out here in its own on-disk
  format (models--ORG--NAME/{blobs,refs/main,snapshots/REV}), offline (HF_HUB_OFFLINE=1);
* a bad setting is one line and exit 2 on every rank count, before any rank starts;
* a finished run started again says there is nothing to do.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mtrain" / "configs" / "tiny_llama_grpo.yaml"


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(REPO), **extra)


def mtrain(*args, cwd, timeout=180, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtrain", *map(str, args)], cwd=cwd, env=env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)


def error_lines(p) -> list[str]:
    return [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("mtrain: error")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from mtrain.tiny_hf import write_tiny_hf
    return write_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "tiny")


def hub_cache(root: Path, repo_id: str, model: Path, rev: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """huggingface_hub's cache layout: file contents under blobs/ (named by their hash), the snapshot's files as
    relative symlinks into blobs/, and refs/main naming the snapshot's revision."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.mark.parametrize("nproc", [1, 2])
def test_folder_without_tokenizer_is_refused_in_one_line(tmp_path, tiny, nproc):
    bare = tmp_path / "smollm2_weights_only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):  # what a user copies when only the weights seem to matter
        shutil.copy(tiny / name, bare / name)
    p = mtrain("train", "--nproc-per-node", nproc, CONFIG, f"model.hf_path={bare}", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = error_lines(p)
    assert line.startswith(f"mtrain: error: ConfigError: model.hf_path: {bare} has no tokenizer files"), line
    assert "tokenizer.json" in line and "Hugging Face repository" in line
    assert "Traceback" not in p.stderr and not (tmp_path / "runs").exists()


def test_hub_id_resolves_offline_from_huggingface_hub_cache(tmp_path, tiny):
    snap = hub_cache(tmp_path / "hub", "tinyorg/tiny-llama", tiny)
    code = ("from mtrain.config import load_config; from mtrain.preflight import preflight\n"
            f"cfg = load_config({str(CONFIG)!r}, ['model.hf_path=tinyorg/tiny-llama', 'train.run_dir=run'])\n"
            "preflight(cfg, world=1); print('RESOLVED', cfg.model.hf_path)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("RESOLVED")]
    assert Path(line.split(" ", 1)[1]) == snap, line
    assert "downloading" not in p.stdout  # cached: nothing to say


def test_hub_id_offline_and_not_cached_is_one_line(tmp_path):
    (tmp_path / "hub").mkdir()
    p = mtrain("train", "--nproc-per-node", 2, CONFIG, "model.hf_path=tinyorg/not-cached", cwd=tmp_path,
               HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = error_lines(p)
    assert line.startswith("mtrain: error: ConfigError: model.hf_path: tinyorg/not-cached is not a local folder and "
                           "not in the Hugging Face cache") and "HF_HUB_OFFLINE=1" in line, line


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_bad_setting_is_one_line_and_exit_2_on_every_rank_count(tmp_path, tiny, nproc):
    p = mtrain("train", "--nproc-per-node", nproc, CONFIG, f"model.hf_path={tiny}", "parallel.tpp=2", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr == ("mtrain: error: ConfigError: unknown config key 'parallel.tpp' (override 'parallel.tpp=2'); "
                        "did you mean 'parallel.tp'?\n")


def test_a_layout_that_needs_the_world_size_is_checked_for_n_ranks(tmp_path, tiny):
    """The launching process checks for the world the ranks will have (3 ranks cannot hold tp=2)."""
    p = mtrain("train", "--nproc-per-node", 3, CONFIG, f"model.hf_path={tiny}", "parallel.tp=2", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = error_lines(p)
    assert line.startswith("mtrain: error: ConfigError: parallel:") and "3" in line, line
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # a 3-step run of 2 ranks and its restart (about a minute on 2 cores)
def test_good_run_names_its_results_and_a_finished_run_has_nothing_to_do(tmp_path, tiny):
    run = tmp_path / "run"
    args = ("train", "--nproc-per-node", 2, CONFIG, f"model.hf_path={tiny}", f"train.run_dir={run}", "train.steps=3",
            "train.save_interval=1", "parallel.tp=2")
    p = mtrain(*args, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count(f"done: results in {run}") == 1 and f"mtrain plot {run}" in p.stdout, p.stdout
    assert (run / "metrics.jsonl").is_file()
    # train.keep_checkpoints (default 2): of the three saves, the newest two are left
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    again = mtrain(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(rf"{re.escape(str(run))} is already trained to train.steps=3 .*nothing to do", again.stdout)
    assert "steps:" not in again.stderr  # nothing started


@pytest.mark.slow  # a 2-rank run stopped after its first checkpoint (about 30 s on 2 cores)
def test_sigterm_to_the_launcher_is_one_line_naming_the_checkpoint_to_resume_from(tmp_path, tiny):
    # was the elastic agent's SignalException traceback and exit status 1
    import signal
    import time
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "mtrain", "train", "--nproc-per-node", "2", str(CONFIG),
                          f"model.hf_path={tiny}", f"train.run_dir={run}", "train.steps=50", "train.save_interval=1",
                          "train.eval_interval=0"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "latest").is_file() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"mtrain: stopped by SIGTERM; every rank was stopped\. The same command resumes from "
                        rf"{re.escape(str(run / 'checkpoints'))}/step_\d+", last), last


@pytest.mark.slow  # a 2-rank start, to the first rewards (about 25 s on 2 cores)
def test_the_closing_line_names_the_rank_that_failed_not_one_the_launcher_stopped(tmp_path, tiny):
    # rank 1 dies (exit 3); the launcher then stops rank 0 with SIGTERM. The line named rank 0 and "signal 15",
    # and the command exited 1
    (tmp_path / "dies_on_rank1.py").write_text(
        "import os\n\ndef reward(response, answer=None, **_):\n"
        "    if os.environ.get('RANK') == '1':\n        os._exit(3)\n    return 0.0\n")
    p = mtrain("train", "--nproc-per-node", 2, CONFIG, f"model.hf_path={tiny}", f"train.run_dir={tmp_path / 'run'}",
               "train.steps=1", f"reward.fn={tmp_path / 'dies_on_rank1.py'}:reward", cwd=tmp_path, timeout=300)
    assert p.returncode == 3, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("mtrain: rank 1 ended with exit status 3 (its output above says "
                                                 "why); the other ranks were stopped"), p.stderr[-3000:]
