"""The generated arithmetic task: right answers, deterministic, eval disjoint from train."""
import ast
import operator

import pytest

from mtrain.data import TaskError, evaluate, exact_match_reward, make_arithmetic_splits


def python_value(expr: str) -> int:
    """Independent reference: Python's own parser and precedence rules."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def ev(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant)
        return node.value
    return ev(ast.parse(expr, mode="eval").body)


def test_two_number_addition_prompt_and_answer():
    train, evals = make_arithmetic_splits(50, 10, seed=3, max_operand=30)
    s = train[0]
    a, b = (int(x) for x in s.metadata["expression"].split(" + "))
    assert s.prompt == f"What is {a} + {b}? Answer with just the number."
    assert s.answer == str(a + b) and 0 <= a <= 30 and 0 <= b <= 30
    assert [x.index for x in train] == list(range(50)) and [x.index for x in evals] == list(range(10))


def test_multi_op_answers_follow_precedence():
    train, evals = make_arithmetic_splits(300, 30, seed=1, max_operand=20, num_operands=4, ops="+-*")
    for s in train + evals:
        assert s.answer == str(python_value(s.metadata["expression"]))
        assert exact_match_reward(f"The answer is {s.answer}.", s.answer) == 1.0
    assert {op for s in train for op in s.metadata["expression"].split() if not op.isdigit()} == {"+", "-", "*"}
    assert any(s.answer.startswith("-") for s in train)  # negative results occur and are well-formed
    assert evaluate([2, 3, 4], ["+", "*"]) == 14 and evaluate([10, 2, 3], ["-", "-"]) == 5


def test_deterministic_per_seed_and_eval_disjoint_from_train():
    a = make_arithmetic_splits(200, 40, seed=7, max_operand=12)
    assert a == make_arithmetic_splits(200, 40, seed=7, max_operand=12)
    assert a != make_arithmetic_splits(200, 40, seed=8, max_operand=12)
    train, evals = a
    eval_exprs = [s.metadata["expression"] for s in evals]
    assert len(set(eval_exprs)) == 40
    assert not set(eval_exprs) & {s.metadata["expression"] for s in train}


def test_impossible_settings_raise():
    # max_operand=1, two operands, "+" -> only 4 distinct problems
    with pytest.raises(TaskError, match="num_eval=4 leaves no train problems: only 4 distinct problems"):
        make_arithmetic_splits(5, 4, seed=0, max_operand=1)
    with pytest.raises(TaskError, match="ops must be a non-empty string"):
        make_arithmetic_splits(5, 1, seed=0, ops="/")
    with pytest.raises(TaskError, match="need num_operands >= 2"):
        make_arithmetic_splits(5, 1, seed=0, num_operands=1)
