"""The names a run writes directly under train.run_dir that no writer module declares itself (the others: metrics'
METRICS_FILE, train_samples' FILE_NAME and EVAL_FILE_NAME, one_step's LEDGER, wandb_log's ID_FILE). What a
train.resume=never start does with them: mtrain/trainer/run_dir.py."""
from __future__ import annotations

CHECKPOINTS = "checkpoints"
CONFIG_FILE = "config.yaml"  # the resolved config, written at every start
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"  # `mtrain plot RUN_DIR`'s default output
WANDB_DIR = "wandb"  # W&B's own files (offline runs wait there for `wandb sync`)
PREVIOUS = "previous"
