"""Every name a run writes directly under train.run_dir, declared here once: the writers import their name from here,
and what a start sets aside (mtrain/trainer/run_dir.py: train.resume=never, or a resume from an earlier step) is
`RUN_OUTPUTS`, so a new output is set aside with the others as soon as it is listed."""
from __future__ import annotations

CHECKPOINTS = "checkpoints"
CONFIG_FILE = "config.yaml"  # the resolved config, written at every start
METRICS_FILE = "metrics.jsonl"  # mtrain/metrics.py
TRAIN_SAMPLES_FILE = "train_samples.jsonl"  # mtrain/trainer/train_samples.py
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # the trainer's evaluate(): a few answers per eval
LEDGER = "trained_prompts.jsonl"  # rollout.async=one_step/stream: each trained step's prompts (sources/one_step.py)
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"  # `mtrain plot RUN_DIR`'s default output
WANDB_ID_FILE = "wandb_run_id"  # the W&B run this run dir logs to (mtrain/wandb_log.py)
WANDB_DIR = "wandb"  # W&B's own files (offline runs wait there for `wandb sync`)
# examples/smollm2/summarize.py (and the tool demo's, through it): a finished demo's numbers and figure
SUMMARY_FILE = "summary.json"
SUMMARY_PLOT = "summary.png"
PREVIOUS = "previous"  # where a start sets an earlier run (or its later steps) aside; never one of RUN_OUTPUTS

# One JSON object per line with its "step": a resume from step k keeps the rows of steps <= k.
STEP_ROWS = (METRICS_FILE, TRAIN_SAMPLES_FILE, EVAL_SAMPLES_FILE, LEDGER)
# About the run as a whole (its config, its figures, its W&B run): they go with the steps a resume leaves behind.
WHOLE_RUN = (CONFIG_FILE, PLOT_FILE, SUMMARY_FILE, SUMMARY_PLOT, WANDB_ID_FILE)
# Tools' own stores, which keep each run's steps apart themselves (TensorBoard's purge_step on a resume, one W&B
# folder per W&B run): a resume leaves them in place, a train.resume=never start moves them with the rest.
STORES = (TENSORBOARD_DIR, WANDB_DIR)
# Checkpoints first: the one resume=auto reads, moved before the rest.
RUN_OUTPUTS = (CHECKPOINTS, *STEP_ROWS, *WHOLE_RUN, *STORES)
