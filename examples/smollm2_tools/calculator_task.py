"""The calculator task of the SmolLM2 tool-use demos, declared once: the system prompt, the worked example and the
problems. Used by train_tool_use.py (HF policy in the script) and make_data.py (the data files that
`mtrain train` reads through config.yaml).

Task: "What is 347 * 829?" (two 3-digit numbers: the model cannot do it in its head). The prompt holds one worked
example (a different product, its call in the qwen25 format, the tool's answer, the final answer); the reward is
1 when the final turn's number is the product (exact_match_reward).
"""
from __future__ import annotations

import random

from mtrain.data import PromptSample

SYSTEM = ("You can use a calculator. To use it, reply with exactly:\n<tool_call>\n{\"name\": \"calculator\", "
          "\"arguments\": {\"expression\": \"EXPRESSION\"}}\n</tool_call>\nThe result comes back in the next "
          "message; then reply with only the final number.")
SHOT = [{"role": "user", "content": "What is 58 * 412?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                                         '"58 * 412"}}\n</tool_call>'},
        {"role": "tool", "content": "23896"},
        {"role": "assistant", "content": "23896"}]
EVAL_SEED, TRAIN_SEED = 12345, 1


def problems(n: int, seed: int, exclude: set = frozenset(), shot: bool = True) -> list[PromptSample]:
    """n distinct (a, b) pairs of 3-digit numbers, none in `exclude`."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(PromptSample(len(out), (SHOT if shot else []) + [{"role": "user", "content": f"What is {a} * {b}?"}],
                                str(a * b), {"pair": [a, b]}))
    return out


def splits(num_train: int, num_eval: int, shot: bool = True) -> tuple[list[PromptSample], list[PromptSample]]:
    """(train, eval): the eval problems are drawn first and never appear in training."""
    eval_set = problems(num_eval, seed=EVAL_SEED, shot=shot)
    train = problems(num_train, seed=TRAIN_SEED, exclude={tuple(s.metadata["pair"]) for s in eval_set}, shot=shot)
    return train, eval_set
