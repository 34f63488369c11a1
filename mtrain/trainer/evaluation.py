"""Evaluation with visible progress: the eval set goes through the rollout in chunks, a bar counts the prompts,
and one line gives the score when it is done.

Without chunks a large eval set is one engine call and the step bar sits frozen for its whole duration (80 s of
"0/28" in the SmolLM2 demo). Ten chunks cost little: each is still a full batch for the engine.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

CHUNKS = 10


def evaluate_in_chunks(rollout: Callable, eval_set: Sequence, n: int, *, step: int, show: bool,
                       chunks: int = CHUNKS) -> tuple[float, list[tuple[object, str, float]]]:
    """rollout(samples, rid_prefix) -> RolloutResult (every rank calls it: it is collective). Returns the mean
    reward and (sample, response, reward) rows in eval-set order; `show` (rank 0) draws the bar and the line."""
    from tqdm.auto import tqdm
    size = max(1, -(-len(eval_set) // chunks))
    rows: list[tuple[object, str, float]] = []
    t0 = time.perf_counter()
    with tqdm(total=len(eval_set), desc=f"eval at step {step}", unit="prompt", leave=False, disable=not show,
              dynamic_ncols=True) as bar:
        for start in range(0, len(eval_set), size):
            part = eval_set[start:start + size]
            res = rollout(part, f"eval{start}")
            rows += [(part[i // n], text, r) for i, (text, r) in enumerate(zip(res.responses, res.rewards))]
            bar.update(len(part))
    mean = sum(r for _, _, r in rows) / len(rows)
    if show:
        tqdm.write(f"eval at step {step}: eval/reward_mean {mean:.4f} over {len(eval_set)} prompts x {n} "
                   f"sample(s) ({time.perf_counter() - t0:.0f} s)")
    return mean, rows
