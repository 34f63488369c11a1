"""examples/math_fractions: the generated folder loads with the example config's keys and splits, every reference
answer verifies against itself and against an unreduced equal fraction, the solved turns before each question are
right and the same in every prompt, and train and test share no problem; every task family's answers are its
questions' values."""
import random
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("math_verify")

from mtrain.config import load_config  # noqa: E402
from mtrain.data import load_datasets  # noqa: E402
from mtrain.data.rewards import math_verify_reward  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "math_fractions"


@pytest.mark.parametrize("fmt", ["datasets", "jsonl"])  # run.sh's CPU and GPU recipes
def test_generated_folder_trains_with_the_example_config(tmp_path, fmt):
    out = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(out), "--train", "40", "--test", "8",
                    "--format", fmt], check=True, capture_output=True, timeout=120)
    paths = [str(out)] * 2 if fmt == "datasets" else [str(out / "train.jsonl"), str(out / "test.jsonl")]
    cfg = load_config(EXAMPLE / "grpo_fractions.yaml", [f"data.train_path={paths[0]}", f"data.eval_path={paths[1]}",
                                                        "model.hf_path=/run.sh/fills/it"])
    train, evals = load_datasets(cfg)
    assert (len(train), len(evals)) == (40, 8)
    assert not {s.prompt[-1]["content"] for s in train} & {s.prompt[-1]["content"] for s in evals}
    shots = evals[0].prompt[:-1]
    assert [m["role"] for m in shots] == ["system"] + ["user", "assistant"] * 3
    for q, a in zip(shots[1::2], shots[2::2]):  # each solved turn's answer is its question's value
        assert Fraction(*map(int, re.fullmatch(r"\\boxed\{\\frac\{(\d+)\}\{(\d+)\}\}", a["content"]).groups())) \
            == sum_of(q["content"])
    for s in evals:
        assert s.prompt[:-1] == shots
        assert s.prompt[-1]["role"] == "user" and "\\boxed{}" in s.prompt[-1]["content"]
        gold = s.answer
        assert math_verify_reward(f"So the result is \\boxed{{{gold}}}.", gold) == 1.0
        # the value in the question, computed here independently, as an unreduced fraction with another denominator
        q = sum_of(s.prompt[-1]["content"])
        assert math_verify_reward(f"\\boxed{{\\frac{{{q.numerator * 3}}}{{{q.denominator * 3}}}}}", gold) == 1.0
        assert math_verify_reward(f"\\boxed{{{q.numerator + 1}/{q.denominator}}}", gold) == 0.0


@pytest.mark.parametrize("task", ["frac_same_den", "frac_pm", "dec_add", "frac_of_int"])
def test_every_family_answers_its_question(tmp_path, task):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import make_data
    finally:
        sys.path.remove(str(EXAMPLE))
    rng = random.Random(3)
    for _ in range(40):
        text, answer = make_data.TASKS[task](rng)
        q = sum_of(text)
        assert math_verify_reward(f"\\boxed{{{answer}}}", answer) == 1.0
        assert math_verify_reward(f"\\boxed{{{q.numerator}/{q.denominator}}}", answer) == 1.0
        assert math_verify_reward(f"\\boxed{{{q.numerator + 1}/{q.denominator}}}", answer) == 0.0


def sum_of(text: str) -> Fraction:
    expr = text.split("$")[1].replace("\\times", "*")
    expr = re.sub(r"\\frac\{(\d+)\}\{(\d+)\}", r"Fraction(\1, \2)", expr)
    expr = re.sub(r"(?<![\d(])(\d+(?:\.\d+)?)(?![\d,)])", r"Fraction('\1')", expr)  # exact decimals, not floats
    return Fraction(eval(expr, {"Fraction": Fraction}))  # noqa: S307 - our own generated text
