"""A verifiable task whose answer length has a heavy tail: "Count from 1 to N" with N drawn from a log-normal.

RL on long chain-of-thought has a long tail of response lengths, and a step waits for its longest sample: this task
reproduces that shape on any model. N ~ LogNormal(log(median_count), sigma), clipped to [1, max_count]; the answer
is "1 2 3 ... N"; each sample carries a token budget `metadata["max_new_tokens"]` of about twice what the answer
needs (6 tokens per number, at least 8), which the rollout honours (min with rollout.max_new_tokens). A model that
never emits EOS -- a random one -- therefore generates exactly a heavy-tailed number of tokens. The reward is the
share of the expected numbers the response gets right, in order (`count_reward`).
"""
from __future__ import annotations

import math
import random

from mtrain.data.datasets import PromptSample

PROMPT = "Count from 1 to {n}, separated by spaces."


def make_longtail_splits(num_train: int, num_eval: int, *, seed: int, median_count: int = 20, sigma: float = 1.0,
                         max_count: int = 400) -> tuple[list[PromptSample], list[PromptSample]]:
    if num_train < 1 or num_eval < 0 or median_count < 1 or sigma < 0 or max_count < median_count:
        raise ValueError(f"longtail task: need num_train >= 1, num_eval >= 0, median_count >= 1, sigma >= 0, "
                         f"max_count >= median_count (got {num_train}, {num_eval}, {median_count}, {sigma}, "
                         f"{max_count})")
    rng = random.Random(seed)

    def sample(i: int) -> PromptSample:
        n = int(min(max_count, max(1, round(rng.lognormvariate(math.log(median_count), sigma)))))
        return PromptSample(index=i, prompt=PROMPT.format(n=n), answer=" ".join(str(k) for k in range(1, n + 1)),
                            metadata={"task": "longtail", "count": n, "max_new_tokens": max(8, 6 * n)})

    evals = [sample(i) for i in range(num_eval)]
    train = [sample(i) for i in range(num_train)]
    return train, evals


def count_reward(response: str, answer, **_) -> float:
    """Share of the expected numbers that the response lists in order from the start (1.0 = exactly right)."""
    want = str(answer).split()
    got = response.replace(",", " ").split()
    ok = 0
    for w, g in zip(want, got):
        if w != g:
            break
        ok += 1
    return ok / max(len(want), len(got), 1)
