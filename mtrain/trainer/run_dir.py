"""One history per run dir: what a start sets aside of an earlier run in train.run_dir, into RUN_DIR/previous/<UTC>/.

A start writes step_N, `latest` and its rows again. Without this module a fresh start (train.resume=never) overwrote
the earlier run's same-step checkpoints and left its higher steps beside the new ones (a later resume=auto then took
the earlier run's newest: two runs mixed), and replaced its metrics and samples; a resume from an earlier step of the
run dir (train.resume=RUN_DIR/checkpoints/step_2 while step_4 exists) wrote over steps 3 and 4 later, while their
rows were dropped. Now rank 0 moves what is not this run's history, each by one rename, after the models are built
(and the resumed checkpoint loaded) and before anything is written; the other ranks wait at a barrier
(loop.Trainer._resume):
- train.resume=never, or a checkpoint outside RUN_DIR/checkpoints (another run dir's: never touched itself): the
  earlier run whole (every RUN_OUTPUTS name), when it left checkpoints. The moved folder is a run dir.
- a checkpoint of RUN_DIR/checkpoints at step k, with checkpoints of later steps beside it: those checkpoints, the
  rows of steps after k of the STEP_ROWS files (the earlier rows stay), and the WHOLE_RUN files (config, figures, the
  W&B run id: a W&B run ignores steps it already has, so the new steps go to a new one). TensorBoard's purge_step
  hides the later events itself.
- resume=auto, or a checkpoint with nothing after it: nothing (steps after k that left rows but no checkpoint run
  again, exactly: their rows are dropped as before).
Nothing is deleted; resume=auto never looks in previous/ (it scans RUN_DIR/checkpoints only); one line says what went
where, how to go on with it and how to remove it. A configured path inside what would move
(model.mcore_ckpt=RUN_DIR/checkpoints/...) is refused before any process group (preflight), as it would be gone
when read. docs/design-trainer.md.
"""
from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from mtrain.config import path_values
from mtrain.fileperm import replace_text
from mtrain.run_files import CHECKPOINTS, PREVIOUS, RUN_OUTPUTS, STEP_ROWS, WHOLE_RUN
from mtrain.trainer.checkpoint import entry_step, point_latest, resume_path, saved_step
from mtrain.trainer.train_samples import row_step


def earlier_outputs(run_dir: str | os.PathLike) -> list[Path]:
    """What an earlier run left in run_dir, when it left checkpoints (anything under RUN_DIR/checkpoints); else []."""
    run_dir = Path(run_dir)
    ckpts = run_dir / CHECKPOINTS
    if not ckpts.is_dir() or not any(ckpts.iterdir()):
        return []
    return [run_dir / name for name in RUN_OUTPUTS if os.path.lexists(run_dir / name)]


def later_outputs(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """What a resume from step `step` moves whole when run_dir's checkpoints go past it: the checkpoint entries of later
    steps (step_N, an unfinished .partial_step_N) and the WHOLE_RUN files; [] when no step_N after `step` exists (an
    unfinished save alone is the resumed run's own, replaced by its next save)."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    entries = [(entry_step(p.name), p) for p in root.iterdir()] if root.is_dir() else []
    later = [p for n, p in sorted((n, p) for n, p in entries if n is not None and n > step)]
    if not any(p.name.startswith("step_") for p in later):
        return []
    return later + [run_dir / name for name in WHOLE_RUN if os.path.lexists(run_dir / name)]


def _in_run_dir(run_dir: Path, checkpoint: Path) -> bool:
    return (run_dir / CHECKPOINTS).resolve() in checkpoint.resolve().parents


def outputs_to_move(run_dir: str | os.PathLike, resume: str, checkpoint: Path | None,
                    step: int | None) -> tuple[list[Path], int | None]:
    """What a start with this train.resume moves into previous/ (checkpoint: the one it resumes from; step: that
    checkpoint's), and the step whose later rows go with it (None: the earlier run moves whole)."""
    run_dir = Path(run_dir)
    if resume == "auto" or (resume != "never" and checkpoint is None):
        return [], None
    if resume == "never" or not _in_run_dir(run_dir, checkpoint):
        return earlier_outputs(run_dir), None
    if step is None:  # a COMPLETE marker without its step (not written by mtrain): the later steps are unknown
        return [], None
    return later_outputs(run_dir, step), step


def _new_folder(run_dir: Path, now: datetime | None) -> Path:
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    root = run_dir / PREVIOUS
    root.mkdir(exist_ok=True)
    dest, n = root / stamp, 1
    while True:
        try:
            dest.mkdir()
            return dest
        except FileExistsError:  # two starts within a second
            dest, n = root / f"{stamp}-{n}", n + 1


def _move_rows_after(path: Path, step: int, dest: Path) -> bool:
    """Move the rows of steps after `step` from `path` into `dest` (a new file); True when there were any. The moved
    rows are written first: a stop between the two writes leaves them in both files, never in neither."""
    if not path.is_file():
        return False
    kept, later = [], []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            (kept if row_step(line) <= step else later).append(line if line.endswith(b"\n") else line + b"\n")
    if not later:
        return False
    dest.write_bytes(b"".join(later))
    replace_text(path, b"".join(kept).decode())  # rows that read are JSON, so UTF-8
    return True


def set_aside(run_dir: str | os.PathLike, resume: str = "never", checkpoint: Path | None = None,
              step: int | None = None, now: datetime | None = None) -> str | None:
    """Move what is not this run's history into RUN_DIR/previous/<UTC time>/ (rank 0 only, outputs_to_move); the line
    saying so, or None when nothing moved. A stop between two renames leaves the rest, moved by the next start."""
    run_dir = Path(run_dir)
    items, cut = outputs_to_move(run_dir, resume, checkpoint, step)
    if not items:
        return None
    dest = _new_folder(run_dir, now)
    for p in items:
        target = dest / p.relative_to(run_dir)
        target.parent.mkdir(exist_ok=True)
        os.rename(p, target)
    if cut is None:
        why = "train.resume=never" if resume == "never" else f"train.resume={checkpoint} (another run dir's)"
        return (f"{why}: the earlier run's {', '.join(p.name for p in items)} moved to {dest}, not mixed with this "
                f"run's (go on with it: train.run_dir={dest}; remove it: rm -r {dest})")
    rows = [name for name in STEP_ROWS if _move_rows_after(run_dir / name, cut, dest / name)]
    root = run_dir / CHECKPOINTS
    if checkpoint.resolve().parent == root.resolve():
        point_latest(root, checkpoint.name)  # `latest` named a step moved away; the resumed one is now the newest
    moved = ", ".join(p.relative_to(run_dir).as_posix() for p in items)
    if rows:
        moved += f"; their rows of {', '.join(rows)}"
    newest = [p.name for p in items if p.name.startswith("step_")][-1]
    return (f"train.resume={checkpoint}: this run dir's steps after {cut} ({moved}) moved to {dest}, not mixed with "
            f"this run's (go on with them: train.resume={dest / CHECKPOINTS / newest}; remove them: rm -r {dest})")


def moved_config_path(cfg) -> str | None:
    """One line when a configured path lies inside what this start would set aside (set_aside), else None."""
    r = cfg.train.resume
    if r == "auto":  # moves nothing; resume_path would check every checkpoint
        return None
    checkpoint = resume_path(r, cfg.train.run_dir, report=None)
    step = saved_step(checkpoint) if checkpoint is not None else None
    items = [p.resolve() for p in outputs_to_move(cfg.train.run_dir, r, checkpoint, step)[0]]
    for key, value in path_values(cfg):
        if key in ("train.run_dir", "train.resume"):
            continue
        path = Path(value.rpartition(":")[0] if ":" in value and not os.path.exists(value) else value).resolve()
        for item in items:
            if path == item or item in path.parents:
                return (f"{key}: {value} lies in {item}, which train.resume={r} moves to "
                        f"{Path(cfg.train.run_dir) / PREVIOUS}/ before the run starts (the earlier run is set aside, "
                        f"not mixed): copy it out of the run dir, or give this run another train.run_dir")
    return None
