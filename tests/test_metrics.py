"""metrics.jsonl writing and resume truncation; the run plot."""
import importlib.util
import json
import struct

import matplotlib.image
import numpy as np
import pytest
import torch

from mtrain.metrics import MetricsError, MetricsWriter, read_metrics
from mtrain.plot import PlotError, plot_run


def step_metrics(step):
    # deterministic per step, like a seeded run: what an uninterrupted and a resumed run both log
    return {"reward/mean": torch.tensor(step / 8), "kl/mean": np.float32(step * 1e-3),
            "logprob_diff/max_abs": 0.01 + step * 1e-4, "tokens": step * 10}


def test_lines_are_flushed_per_step_and_values_are_plain(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False, progress=False)
    w.log(1, step_metrics(1))
    w.log(1, {"eval/reward/mean": 0.5, "phase": "eval"})  # more than one record per step is fine
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # readable before close
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.125, "kl/mean": pytest.approx(1e-3),
                                    "logprob_diff/max_abs": 0.0101, "tokens": 10}
    assert json.loads(lines[1]) == {"step": 1, "eval/reward/mean": 0.5, "phase": "eval"}
    w.close()


@pytest.mark.parametrize("step, metrics, message", [
    (0, {"x": 1}, "step 0 logged after step 2: steps must not go back"),
    (3, {"x": torch.ones(2)}, "metric 'x' is not a scalar"),
    (3, {"x": [1, 2]}, "metric 'x' has type list"),
    (3, {"step": 1}, "must not contain the key 'step'"),
    (-1, {"x": 1}, "step must be a non-negative int"),
])
def test_bad_logs(tmp_path, step, metrics, message):
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        w.log(2, {"x": 1})
        with pytest.raises(MetricsError, match=message):
            w.log(step, metrics)


def test_resumed_file_equals_uninterrupted(tmp_path):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    with MetricsWriter(full, tensorboard=False, progress=False) as w:
        for s in range(1, 7):
            w.log(s, step_metrics(s))
    with MetricsWriter(crashed, tensorboard=False, progress=False) as w:
        for s in range(1, 6):
            w.log(s, step_metrics(s))
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # killed mid-write
    with MetricsWriter(crashed, resume_step=3, tensorboard=False, progress=False) as w:  # checkpoint of step 3
        assert [r["step"] for r in read_metrics(crashed)] == [1, 2, 3]
        for s in range(4, 7):
            w.log(s, step_metrics(s))
    assert (crashed / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    assert not [p for p in crashed.iterdir() if p.name.endswith(".tmp")]


def test_fresh_run_replaces_an_old_file(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        w.log(5, {"x": 1})
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        w.log(1, {"x": 2})
    assert read_metrics(tmp_path) == [{"step": 1, "x": 2}]


def test_broken_line_in_the_middle_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)
    with pytest.raises(MetricsError, match="no metrics file at"):
        read_metrics(tmp_path / "nowhere")


def test_progress_bar_and_tensorboard(tmp_path, capsys, caplog):
    with MetricsWriter(tmp_path, total_steps=3, progress=True, tensorboard=True) as w:
        for s in (1, 2, 3):
            w.log(s, step_metrics(s))
    err = capsys.readouterr().err
    assert "3/3" in err and "reward=0.375" in err
    if importlib.util.find_spec("tensorboard") is None:
        assert "TensorBoard is not installed" in caplog.text
    else:
        assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_run_writes_a_png_of_the_documented_size(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        for s in range(1, 21):
            w.log(s, step_metrics(s))
            if s % 5 == 0:
                w.log(s, {"eval/reward/mean": s / 25})
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png" and png_size(out) == (800, 780)  # 8 in x 2.6 in per panel, 100 dpi
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (780, 800) and pixels.std() > 0.05  # decodes, and is not a blank canvas
    custom = plot_run(tmp_path, tmp_path / "plots" / "r.png", keys=["reward/mean"])
    assert png_size(custom) == (800, 260)


def test_plot_missing_keys_name_them_and_the_present_ones(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, progress=False) as w:
        w.log(1, {"reward/mean": 0.5, "loss/total": 1.0})
    with pytest.raises(PlotError) as e:
        plot_run(tmp_path)
    msg = str(e.value)
    # kl/mean is optional among the defaults (a run without a KL reference logs none); the others are not
    assert "no values for ['logprob_diff/max_abs']" in msg
    assert "keys present: ['loss/total', 'reward/mean']" in msg
    assert not (tmp_path / "metrics.png").exists()
    with pytest.raises(PlotError, match="no metrics file"):
        plot_run(tmp_path / "empty_run")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="has no records yet"):
        plot_run(tmp_path)
