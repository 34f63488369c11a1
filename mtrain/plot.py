"""`mtrain plot RUN_DIR`: the curves an RL run is judged by, from RUN_DIR/metrics.jsonl, into a PNG.

reward/mean (with eval/reward_mean on the same axes when logged), kl/mean (policy vs reference) and
logprob_diff/max_abs (engine vs trainer logprobs: a growing value means the weight sync is off); with PPO's critic or
distillation also critic/value_loss, critic/explained_var, critic/vpred_mean, distill/reverse_kl.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Sequence

from mtrain.fileperm import chmod_umask
from mtrain.metrics import MetricsError, read_metrics
from mtrain.run_files import METRICS_FILE, PLOT_FILE

DEFAULT_KEYS = ("reward/mean", "kl/mean", "logprob_diff/max_abs")
# PPO's critic and on-policy distillation: panels added to the default ones when the run logged them. A run without
# a KL reference (algo.kl_coef=0) logs no kl/mean: the default panels then leave it out.
ALGO_KEYS = ("critic/value_loss", "critic/explained_var", "critic/vpred_mean", "distill/reverse_kl")
OVERLAYS = {"reward/mean": "eval/reward_mean"}
# What each panel shows, in words a reader of the PNG alone understands (the metric's name stays in the y label).
TITLES = {
    "reward/mean": "training reward (step mean)",
    "eval/reward_mean": "held-out eval",
    "kl/mean": "KL of the policy from the reference model",
    "logprob_diff/max_abs": "engine vs trainer logprob, largest gap (growing = sync off)",
    "logprob_diff/mean_abs": "engine vs trainer logprob, mean gap per token",
    "response_len/mean": "response length (tokens, mean)",
    "critic/value_loss": "critic value loss",
    "critic/explained_var": "critic explained variance (1 = perfect, 0 = no better than the mean)",
    "critic/vpred_mean": "critic value prediction (mean)",
    "distill/reverse_kl": "reverse KL to the teacher",
}
WIDTH_IN, ROW_HEIGHT_IN, DPI = 8.0, 2.6, 100  # the PNG is 800 x (260 * rows) pixels


class PlotError(MetricsError):
    """A run whose metrics cannot be plotted; the message names the keys and the file."""


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


PERCENT_KEYS = ("reward/mean", "eval/reward_mean")  # rewards in [0, 1] read as shares (accuracy, pass rate)


def _fmt(v: float, key: str) -> str:
    """A reward in [0, 1] as a percentage; anything else with 3 significant digits."""
    return f"{100 * v:.1f} %" if key in PERCENT_KEYS and 0.0 <= v <= 1.0 else f"{v:.3g}"


def panel_title(key: str, series: tuple[list[int], list[float]],
                overlay: tuple[str | None, tuple[list[int], list[float]]] = (None, ([], []))) -> str:
    """A panel's title: what it shows in words, its first and last values and steps, and its overlay's (evals)."""
    steps, values = series
    title = (f"{TITLES.get(key, key)}: {_fmt(values[0], key)} at step {steps[0]} -> "
             f"{_fmt(values[-1], key)} at step {steps[-1]}")
    name, (o_steps, o_values) = overlay
    if name and o_steps:
        title += f"; {TITLES.get(name, name)} {_fmt(o_values[0], name)} -> {_fmt(o_values[-1], name)}"
    return title


def plot_run(run_dir: str | os.PathLike, out_png: str | os.PathLike | None = None,
             keys: Sequence[str] = DEFAULT_KEYS) -> Path:
    """Draw each key against step, one panel per key; returns the PNG path (default RUN_DIR/metrics.png)."""
    run_dir = Path(run_dir)
    try:
        records = read_metrics(run_dir)
    except MetricsError as e:
        hint = "" if run_dir.is_dir() else " (not a directory: give a run's train.run_dir)"
        raise PlotError(f"{e}{hint}") from None
    if not records:
        raise PlotError(f"{run_dir / METRICS_FILE} has no records yet")
    if tuple(keys) == DEFAULT_KEYS:
        keys = [k for k in DEFAULT_KEYS if k != "kl/mean" or _series(records, k)[0]] + \
            [k for k in ALGO_KEYS if _series(records, k)[0]]
    series = {k: _series(records, k) for k in keys}
    missing = [k for k, (steps, _) in series.items() if not steps]
    if missing:
        available = sorted({k for r in records for k in r if k != "step"})
        raise PlotError(f"{run_dir / METRICS_FILE}: no values for {missing}; keys present: {available}")

    # The object-oriented API: no pyplot global state, no GUI backend, safe inside notebooks.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(WIDTH_IN, ROW_HEIGHT_IN * len(keys)), dpi=DPI)
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps, values = series[key]
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
        overlay = OVERLAYS.get(key)
        o_steps, o_values = _series(records, overlay) if overlay else ([], [])
        ax.set_title(panel_title(key, series[key], (overlay, (o_steps, o_values))), fontsize="small", loc="left")
        if o_steps:
            # evals are a few separate measurements: points with their values, not a line through them
            ax.plot(o_steps, o_values, marker="o", linestyle="none", label=f"{overlay} ({TITLES.get(overlay, overlay)})")
            for x, y in zip(o_steps, o_values):
                ax.annotate(_fmt(y, overlay), (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize="x-small")
            ax.legend(loc="best", fontsize="small")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out_png) if out_png is not None else run_dir / PLOT_FILE
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".png")
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}") from None
    os.close(fd)
    chmod_umask(tmp)  # mkstemp makes 0600; the plot is for anyone the umask allows
    try:
        fig.savefig(tmp, format="png", dpi=DPI)  # no bbox_inches="tight": the size stays as documented
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return out
