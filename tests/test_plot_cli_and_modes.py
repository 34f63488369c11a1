"""`mtrain plot` on bad input is one line and exit 2; files we write follow the user's umask (issue 19, point 12)."""
from __future__ import annotations

import os
import stat

import pytest

from mtrain.__main__ import main
from mtrain.config import load_config
from mtrain.metrics import MetricsWriter


@pytest.mark.parametrize("case, match", [
    ("missing", r"no metrics file at .* \(not a directory: give a run.s train\.run_dir\)"),
    ("empty_dir", "no metrics file at .*metrics.jsonl"),
    ("garbage", r"metrics\.jsonl:1: not a JSON line"),
    ("unwritable_out", "cannot write .*: "),
])
def test_plot_bad_input_is_one_line_exit_2(tmp_path, capsys, case, match):
    import re
    run = tmp_path / "run"
    args = [str(run)]
    if case != "missing":
        run.mkdir()
    if case == "garbage":
        (run / "metrics.jsonl").write_text("not json\n{\"step\": 1}\n")
    if case == "unwritable_out":
        with MetricsWriter(run, tensorboard=False, progress=False) as w:
            for s in (1, 2):
                w.log(s, {"reward/mean": 0.1 * s, "kl/mean": 0.0, "logprob_diff/max_abs": 0.0})
        (tmp_path / "file").write_text("")
        args += ["--out", str(tmp_path / "file" / "x.png")]  # a path under a regular file
    assert main(["plot", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtrain: error: PlotError: ") and re.search(match, err[0]), err


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_config_metrics_and_plot_follow_the_umask(tmp_path, umask_027):
    cfg = load_config(None, ["model.hf_path=x", "data.task=arithmetic"])
    assert mode(cfg.dump_yaml(tmp_path / "config.yaml")) == umask_027  # was 0600 (mkstemp)
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        for s in (1, 2):
            w.log(s, {"reward/mean": 0.1 * s, "kl/mean": 0.0, "logprob_diff/max_abs": 0.0})
    assert mode(tmp_path / "metrics.jsonl") == umask_027
    assert main(["plot", str(tmp_path)]) == 0
    assert mode(tmp_path / "metrics.png") == umask_027


def test_init_tiny_follows_the_umask(tmp_path, umask_027):
    from mtrain.tiny_hf import write_tiny_hf
    out = write_tiny_hf("llama", tmp_path / "hf")
    assert {f.name: mode(f) for f in out.iterdir()} == {f.name: umask_027 for f in out.iterdir()}


def test_panel_titles_say_what_a_panel_shows_and_its_first_and_last_values():
    from mtrain.plot import panel_title

    title = panel_title("reward/mean", ([1, 2, 28], [0.24, 0.5, 0.78]), ("eval/reward_mean", ([0, 28], [0.336, 0.766])))
    assert title == ("training reward (step mean): 24.0 % at step 1 -> 78.0 % at step 28; "
                     "held-out eval 33.6 % -> 76.6 %")
    # a gap is a number, not a share; an unknown key keeps its name
    assert panel_title("logprob_diff/max_abs", ([1, 2], [6e-05, 3e-05])).endswith(": 6e-05 at step 1 -> 3e-05 at step 2")
    assert panel_title("my/metric", ([3], [2.5])) == "my/metric: 2.5 at step 3 -> 2.5 at step 3"


@pytest.mark.parametrize("args, match", [
    (["--arch", "nosuch"], r"--arch nosuch: not a tiny architecture; one of: .*\bllama\b"),  # was KeyError
    (["--arch", "llama", "--set", "hidden_size"], r"--set hidden_size: must look like key=value"),  # was ValueError
    (["--arch", "llama", "--set", "model_type=llama"],  # was json's JSONDecodeError
     r"--set model_type=llama: the value must be JSON \(a string in quotes: model_type='\"llama\"'\)"),
    (["--config", "/nonexistent/config.json"], r"--config /nonexistent/config\.json: cannot read it"),
    (["--arch", "llama", "--out", "{file}/hf"], r"--out .*/file is a file, not a folder"),  # was NotADirectoryError
])
def test_init_tiny_bad_input_is_one_line_exit_2(tmp_path, capsys, args, match):
    import re
    (tmp_path / "file").write_text("")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "hf")]
    assert main(["init-tiny", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtrain init-tiny: error: ") and re.search(match, err[0]), err
    assert not (tmp_path / "hf").exists()
