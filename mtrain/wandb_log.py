"""Weights & Biases as one more sink of MetricsWriter (train.log_wandb): the same records as metrics.jsonl under the
same names and steps, the resolved config once (as the run's config), and eval samples as a table per eval.

Rank 0 only (it lives in the MetricsWriter, which only rank 0 creates). The run id is kept in RUN_DIR/wandb_run_id,
so a resumed run continues the same W&B run (W&B ignores the steps it already has; metrics.jsonl is the record that
drops them). Offline mode (train.wandb.mode=offline or WANDB_MODE=offline) needs no network: the run is written
under RUN_DIR/wandb/ and uploaded later with `wandb sync`.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

from mtrain.run_files import WANDB_ID_FILE


class WandbSink:
    def __init__(self, run_dir: str | os.PathLike, config: Mapping[str, Any], *, project: str,
                 entity: str | None = None, name: str | None = None, tags: Sequence[str] = (),
                 mode: str | None = None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("train.log_wandb is true, but wandb is not installed: pip install 'mtrain[wandb]'") \
                from None
        self._wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, entity=entity, name=name or run_dir.resolve().name, tags=list(tags),
                              config=dict(config), dir=str(run_dir), id=run_id, resume="allow",
                              mode=mode or os.environ.get("WANDB_MODE") or "online")

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        if values:
            self.run.log(values, step=step)

    def log_table(self, step: int, key: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = list(rows[0])
        table = self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log({key: table}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_sink(cfg: Any, run_dir: str | os.PathLike) -> WandbSink | None:
    """The sink a RunConfig asks for (train.log_wandb, train.wandb.*), or None."""
    t = cfg.train
    if not t.log_wandb:
        return None
    w = t.wandb
    return WandbSink(run_dir, cfg.to_dict(), project=w.project, entity=w.entity, name=w.name, tags=w.tags,
                     mode=w.mode)
