"""Per-step metrics: one JSON line per log call in RUN_DIR/metrics.jsonl, TensorBoard when installed, and a
tqdm progress bar. Create it on one rank only (rank 0).

Resuming from the checkpoint of step k keeps the lines with step <= k and drops the rest (the steps that
ran after the checkpoint and will run again), so a resumed run's file equals an uninterrupted run's. Rows of steps
that have a checkpoint after k (a resume from an earlier step) were moved to RUN_DIR/previous/ first
(mtrain/trainer/run_dir.py).
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

from mtrain.fileperm import replace_text
from mtrain.run_files import METRICS_FILE, TENSORBOARD_DIR

log = logging.getLogger(__name__)


class MetricsError(ValueError):
    """Metrics that cannot be written or read; the message names the key/file."""


def read_metrics(run_dir_or_file: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a run dir or the file). A torn last line (a crash mid-write) is
    skipped; a broken line elsewhere is an error naming the line."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"no metrics file at {path}")
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # the last line without its newline: torn write
                log.warning("%s: ignoring a torn last line", path)
                continue
            raise MetricsError(f"{path}:{lineno}: not a JSON line") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise MetricsError(f"{path}:{lineno}: each line must be an object with an integer 'step'")
        records.append(rec)
    return records


def _plain(key: str, value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars (one GPU sync per value)
        try:
            value = value.item()
        except (RuntimeError, ValueError):
            raise MetricsError(f"metric '{key}' is not a scalar (shape {getattr(value, 'shape', '?')})") from None
    if isinstance(value, bool) or isinstance(value, (int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value
    raise MetricsError(f"metric '{key}' has type {type(value).__name__}; expected a number or string")


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int | None = None,
                 total_steps: int | None = None, tensorboard: bool | None = None, progress: bool = True,
                 progress_keys: tuple[str, ...] = ("reward/mean", "kl/mean"), sinks: tuple[Any, ...] = ()):
        """resume_step: the last step the resumed checkpoint completed (None = a fresh run: any previous
        metrics file in run_dir is replaced). tensorboard: None = when installed (silently off otherwise),
        True = wanted (a warning when not installed; `mtrain train` refuses to start then), False = off.
        sinks: more destinations of every record, with log(step, record), log_table(step, key, rows), close()
        (mtrain/wandb_log.py)."""
        self._sinks = tuple(sinks)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._rewrite_kept_lines(resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self.last_step = resume_step if resume_step is not None else -1
        self._tb = self._open_tensorboard(resume_step, tensorboard) if tensorboard is not False else None
        self._progress_keys = progress_keys
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=max(resume_step or 0, 0), desc="steps",
                             dynamic_ncols=True)

    def _rewrite_kept_lines(self, resume_step: int | None) -> None:
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [json.dumps(r) for r in read_metrics(self.path) if r["step"] <= resume_step]
        elif resume_step is None and self.path.exists():
            log.info("fresh run: replacing %s", self.path)
        replace_text(self.path, "".join(line + "\n" for line in kept))  # the old file or the new, never half

    def _open_tensorboard(self, resume_step: int | None, wanted: bool | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if not wanted:  # None: TensorBoard is optional; metrics.jsonl has everything
                return None
            log.warning("TensorBoard is not installed (pip install tensorboard); logging to %s only", self.path)
            return None
        # purge_step hides the events past the checkpoint that an interrupted run had written.
        purge = resume_step + 1 if resume_step is not None else None
        return SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record {"step": step, **metrics}; several calls for the same step are allowed."""
        if not isinstance(step, int) or step < 0:
            raise MetricsError(f"step must be a non-negative int, got {step!r}")
        if step < self.last_step:
            raise MetricsError(f"step {step} logged after step {self.last_step}: steps must not go back")
        if "step" in metrics:
            raise MetricsError("metrics must not contain the key 'step' (it is the record's own field)")
        record: dict[str, Any] = {"step": step}
        record.update({k: _plain(k, v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for sink in self._sinks:
            sink.log(step, record)
        if self._bar is not None:
            if step > self.last_step and step > self._bar.n:
                self._bar.update(step - self._bar.n)
            shown = {k.split("/")[0] if k.endswith("/mean") else k: f"{record[k]:.4g}"
                     for k in self._progress_keys if isinstance(record.get(k), (int, float))
                     and not (isinstance(record[k], float) and math.isnan(record[k]))}
            if shown:
                self._bar.set_postfix(shown, refresh=True)
        self.last_step = step
        return record

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """Rows of one table (eval samples) to the sinks that show tables; the jsonl files keep their own."""
        for sink in self._sinks:
            sink.log_table(step, key, rows)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = ()
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
