"""A verifiable arithmetic task generated from a seed: "What is 17 + 25? Answer with just the number." -> "42".

The eval set is drawn first and kept disjoint from the train set, so eval reward measures generalisation.
Answers are computed with ordinary precedence (* before + and -) by a tiny evaluator, never eval().
"""
from __future__ import annotations

import random

from mtrain.data.datasets import PromptSample

PROMPT_TEMPLATE = "What is {expr}? Answer with just the number."


class TaskError(ValueError):
    """Task settings that cannot produce the requested data."""


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Left-to-right with * binding tighter than + and -: evaluate([2, 3, 4], ['+', '*']) == 14."""
    terms = [operands[0]]  # products folded in, signs applied: the result is sum(terms)
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        elif op == "+":
            terms.append(x)
        elif op == "-":
            terms.append(-x)
        else:
            raise TaskError(f"unknown operator {op!r}")
    return sum(terms)


def _problem(rng: random.Random, max_operand: int, num_operands: int, ops: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    operands = tuple(rng.randint(0, max_operand) for _ in range(num_operands))
    chosen = tuple(rng.choice(ops) for _ in range(num_operands - 1))
    return operands, chosen


def _sample(operands: tuple[int, ...], ops: tuple[str, ...], index: int) -> PromptSample:
    expr = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
    answer = str(evaluate(list(operands), list(ops)))
    return PromptSample(index=index, prompt=PROMPT_TEMPLATE.format(expr=expr), answer=answer,
                        metadata={"task": "arithmetic", "expression": expr})


def make_arithmetic_splits(num_train: int, num_eval: int, *, seed: int, max_operand: int = 50,
                           num_operands: int = 2, ops: str = "+") -> tuple[list[PromptSample], list[PromptSample]]:
    """(train, eval) samples. Eval problems are distinct; train problems never appear in eval (repeats
    within train are allowed when the problem space is small)."""
    if not ops or set(ops) - set("+-*"):
        raise TaskError(f"ops must be a non-empty string of '+', '-', '*', got {ops!r}")
    if num_operands < 2 or max_operand < 1 or num_train < 1 or num_eval < 0:
        raise TaskError(f"need num_operands >= 2, max_operand >= 1, num_train >= 1, num_eval >= 0 "
                        f"(got {num_operands}, {max_operand}, {num_train}, {num_eval})")
    ops = "".join(sorted(set(ops)))  # "++-" and "-+" mean the same task
    space = (max_operand + 1) ** num_operands * len(ops) ** (num_operands - 1)
    if num_eval >= space:
        raise TaskError(f"num_eval={num_eval} leaves no train problems: only {space} distinct problems with "
                        f"max_operand={max_operand}, num_operands={num_operands}, ops={ops!r}")
    rng = random.Random(seed)
    eval_problems: dict[tuple, None] = {}  # insertion-ordered set: deterministic order
    while len(eval_problems) < num_eval:
        eval_problems[_problem(rng, max_operand, num_operands, ops)] = None
    train = []
    while len(train) < num_train:
        p = _problem(rng, max_operand, num_operands, ops)
        if p not in eval_problems:
            train.append(_sample(*p, index=len(train)))
    evals = [_sample(*p, index=i) for i, p in enumerate(eval_problems)]
    return train, evals
