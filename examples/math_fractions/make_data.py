"""Fraction arithmetic with LaTeX answers, written as a HF dataset (save_to_disk, splits train/test) in the verl
layout: `prompt` = chat messages, `reward_model.ground_truth` = the reduced answer as LaTeX (\\frac{7}{12}, -\\frac{1}{6},
2). math_verify_reward compares by value, so \\frac{14}{24}, 7/12 or \\dfrac{7}{12} all score (and 0.5 for
\\frac{1}{2}); exact string match would not. About 640 distinct problems exist: train + test must stay below.
    python examples/math_fractions/make_data.py OUT_DIR [--train N] [--test N] [--seed S]
"""
from __future__ import annotations

import argparse
import random
from fractions import Fraction

INSTRUCTION = "Put the final answer, as a reduced fraction, in \\boxed{}."
BOXED = "Put the final answer in \\boxed{}."
# A short-answer reply keeps CPU rollouts short (max_new_tokens 24 in grpo_fractions.yaml).
SYSTEM_PROMPT = "You are a calculator. Reply with only the final answer in \\boxed{}."


def latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def frac_pm(rng: random.Random) -> tuple[str, Fraction]:
    """a/b +- c/d with numerators 1-5, denominators 2-6 (about 640 distinct problems)."""
    a, b = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    text = f"What is ${latex(a) if a.denominator > 1 else a}{op}{latex(b) if b.denominator > 1 else b}$?"
    return f"{text} {INSTRUCTION}", value


def frac_same_den(rng: random.Random) -> tuple[str, Fraction]:
    """a/n + b/n: add the numerators (the value is what math-verify compares, so 4/6 and 2/3 both score)."""
    n = rng.randint(3, 12)
    a, b = rng.randint(1, n - 1), rng.randint(1, n - 1)
    return f"What is $\\frac{{{a}}}{{{n}}}+\\frac{{{b}}}{{{n}}}$? {BOXED}", Fraction(a + b, n)


def dec_add(rng: random.Random) -> tuple[str, Fraction]:
    """x.y + z.w with one decimal digit (answers like 7.3 or 12)."""
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return f"What is ${a / 10:g}+{b / 10:g}$? {BOXED}", Fraction(a + b, 10)


def frac_of_int(rng: random.Random) -> tuple[str, Fraction]:
    """1/k of a multiple of k (an integer answer)."""
    k = rng.randint(2, 9)
    m = k * rng.randint(2, 12)
    return f"What is $\\frac{{1}}{{{k}}}\\times {m}$? {BOXED}", Fraction(m, k)


TASKS = {"frac_pm": frac_pm, "frac_same_den": frac_same_den, "dec_add": dec_add, "frac_of_int": frac_of_int}


def answer_latex(q: Fraction, task: str) -> str:
    if task == "dec_add":
        return f"{float(q):g}"
    return latex(q)


def records(n: int, rng: random.Random, seen: set[str]) -> list[dict]:
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise SystemExit(f"only {len(seen)} distinct problems found; ask for fewer")
        text, value = problem(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": [{"role": "user", "content": f"{text} {INSTRUCTION}"}], "data_source": "fractions",
                    "reward_model": {"style": "rule", "ground_truth": latex(value)}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--test", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import datasets

    rng, seen = random.Random(args.seed), set()
    test = records(args.test, rng, seen)  # drawn first: no test problem is in train
    train = records(args.train, rng, seen)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(args.out)
    print(f"{args.out}: {len(train)} train, {len(test)} test; e.g. {train[0]['prompt'][0]['content']!r} -> "
          f"{train[0]['reward_model']['ground_truth']!r}")


if __name__ == "__main__":
    main()
