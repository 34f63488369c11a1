"""What a run writes into train.run_dir, and an earlier run's outputs set aside on a `train.resume=never` start.

A fresh start in a run dir that holds checkpoints writes step_N and `latest` again. Before this module it overwrote
the earlier run's same-step checkpoints, left its higher steps beside the new ones (a later resume=auto then took the
earlier run's newest: two runs mixed), and replaced its metrics and samples. Now rank 0 moves every output of the
earlier run (`run_outputs()`) into RUN_DIR/previous/<UTC time>/, each by one rename (checkpoints first), after the
models are built and before anything is written; the other ranks wait at a barrier (loop.Trainer._resume). Nothing is
deleted; resume=auto never looks there (it scans RUN_DIR/checkpoints only); one line says where it went, how to
resume it and how to remove it. A run dir without checkpoints starts in place as before: a run that saved nothing
has nothing to resume or to mix. A configured path inside what would move (model.mcore_ckpt=RUN_DIR/checkpoints/...)
is refused before any process group (preflight), as it would be gone when read. docs/design-trainer.md.
"""
from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from mtrain.config import path_values
from mtrain.metrics import METRICS_FILE
from mtrain.run_files import CHECKPOINTS, CONFIG_FILE, PLOT_FILE, PREVIOUS, TENSORBOARD_DIR, WANDB_DIR
from mtrain.trainer.sources.one_step import LEDGER
from mtrain.trainer.train_samples import EVAL_FILE_NAME, FILE_NAME
from mtrain.wandb_log import ID_FILE


def run_outputs() -> tuple[str, ...]:
    """Every name a run writes directly under RUN_DIR (checkpoints first: the one resume=auto reads)."""
    return (CHECKPOINTS, CONFIG_FILE, METRICS_FILE, FILE_NAME, EVAL_FILE_NAME, LEDGER, TENSORBOARD_DIR, PLOT_FILE,
            ID_FILE, WANDB_DIR)


def earlier_outputs(run_dir: str | os.PathLike) -> list[Path]:
    """What an earlier run left in run_dir, when it left checkpoints (anything under RUN_DIR/checkpoints); else []."""
    run_dir = Path(run_dir)
    ckpts = run_dir / CHECKPOINTS
    if not ckpts.is_dir() or not any(ckpts.iterdir()):
        return []
    return [run_dir / name for name in run_outputs() if os.path.lexists(run_dir / name)]


def set_aside(run_dir: str | os.PathLike, now: datetime | None = None) -> str | None:
    """Move the earlier run's outputs into RUN_DIR/previous/<UTC time>/ (rank 0 only); the line saying so, or None
    when there was nothing to move. A stop between two renames leaves the rest in run_dir, moved by the next start."""
    items = earlier_outputs(run_dir)
    if not items:
        return None
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    root = Path(run_dir) / PREVIOUS
    root.mkdir(exist_ok=True)
    dest, n = root / stamp, 1
    while True:
        try:
            dest.mkdir()
            break
        except FileExistsError:  # two starts within a second
            dest, n = root / f"{stamp}-{n}", n + 1
    for p in items:
        os.rename(p, dest / p.name)
    return (f"train.resume=never: the earlier run's {', '.join(p.name for p in items)} moved to {dest}, not mixed with "
            f"this run's (go on with it: train.run_dir={dest}; remove it: rm -r {dest})")


def moved_config_path(cfg) -> str | None:
    """One line when a configured path lies inside what a train.resume=never start would move aside, else None."""
    if cfg.train.resume != "never":
        return None
    items = [p.resolve() for p in earlier_outputs(cfg.train.run_dir)]
    for key, value in path_values(cfg):
        if key in ("train.run_dir", "train.resume"):
            continue
        path = Path(value.rpartition(":")[0] if ":" in value and not os.path.exists(value) else value).resolve()
        for item in items:
            if path == item or item in path.parents:
                return (f"{key}: {value} lies in {item}, which train.resume=never moves to "
                        f"{Path(cfg.train.run_dir) / PREVIOUS}/ before the run starts (the earlier run is set aside, "
                        f"not mixed): copy it out of the run dir, or give this run another train.run_dir")
    return None
