"""RUN_DIR/train_samples.jsonl: a few of each step's training rollouts, as text, with their rewards.

So that a new reward function can be checked against what the model really says without an eval file: each step
adds the first group's first SAMPLES_PER_STEP samples (one prompt, several answers: the spread GRPO learns from),
`{"step", "row", "reward", "prompt", "response"}`, decoded with the run's tokenizer (special tokens kept: what the
reward saw is the response text after them). Bounded: each text is cut to MAX_CHARS, and the file stops growing at
MAX_FILE_BYTES (a line says so). Written by rank 0 only; every rank holds the same rollout batch.
"""
from __future__ import annotations

import json
from pathlib import Path

from mtrain.run_files import EVAL_SAMPLES_FILE, TRAIN_SAMPLES_FILE

SAMPLES_PER_STEP = 4
MAX_CHARS = 2000
MAX_FILE_BYTES = 16 << 20


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + f"... [{len(text) - MAX_CHARS} more characters]"


def sample_rows(batch, tokenizer, step: int, count: int = SAMPLES_PER_STEP) -> list[dict]:
    """The first `count` rows of a RolloutBatch (tokens padded at the end: prompt, then response, then padding)."""
    rows = []
    for i in range(min(count, batch.size)):
        end = int(batch.seq_lens[i])
        start = end - int(batch.response_lens[i])
        ids = batch.tokens[i].tolist()
        rows.append({"step": step, "row": i, "reward": float(batch.rewards[i]),
                     "prompt": _cut(tokenizer.decode(ids[:start])), "response": _cut(tokenizer.decode(ids[start:end]))})
    return rows


def write_train_samples(run_dir: str | Path, step: int, batch, tokenizer, rank: int) -> None:
    """Append this step's few samples to RUN_DIR/train_samples.jsonl (rank 0; a no-op elsewhere)."""
    if rank != 0:
        return
    path = Path(run_dir) / TRAIN_SAMPLES_FILE
    size = path.stat().st_size if path.exists() else 0
    if size >= MAX_FILE_BYTES:
        return
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in sample_rows(batch, tokenizer, step)]
    if size + sum(len(x.encode()) for x in lines) >= MAX_FILE_BYTES:
        note = f"{TRAIN_SAMPLES_FILE} reached its bound of {MAX_FILE_BYTES >> 20} MB: no further samples are written"
        lines = [json.dumps({"step": step, "note": note}) + "\n"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)


def row_step(line: str | bytes) -> float:
    """The step of one row of a run dir's JSON-lines file; a row that does not read (cut short by a stop) counts as
    after every step."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
    return step if isinstance(step, int) else float("inf")


def keep_rows_through(run_dir: str | Path, resume_step: int | None) -> None:
    """On resuming from step k's checkpoint, keep the sample files' rows of steps <= k (none on a fresh start), as
    metrics.jsonl does: the steps after k run again and write their rows again. A line cut short by a stop is
    dropped. Rank 0, before the first step."""
    from mtrain.fileperm import replace_text
    for name in (TRAIN_SAMPLES_FILE, EVAL_SAMPLES_FILE):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            if resume_step is not None and row_step(line) <= resume_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        replace_text(path, "".join(kept))  # the old file or the new, never half
