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


def latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def problem(rng: random.Random) -> tuple[str, Fraction]:
    a, b = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    text = f"What is ${latex(a) if a.denominator > 1 else a}{op}{latex(b) if b.denominator > 1 else b}$?"
    return text, value


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
