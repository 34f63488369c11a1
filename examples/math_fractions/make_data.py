"""Small arithmetic problems with LaTeX answers in \\boxed{}, written as a HF dataset (save_to_disk, splits
train/test) in the verl layout: `prompt` = chat messages (a system line, `--shots` solved problems of the same family
as earlier turns, then the question), `reward_model.ground_truth` = the answer as LaTeX. Task families (`--task`):
frac_same_den (the default: \\frac{7}{9}+\\frac{1}{9} -> \\frac{8}{9}), frac_pm (a/b +- c/d, reduced), dec_add (4.6+7.5),
frac_of_int (\\frac{1}{8}\\times 64). math_verify_reward compares by value, so \\frac{16}{18}, 8/9 or \\dfrac{8}{9} all
score where exact string match would not. Train + test must stay below the family's distinct problems (~500 for
frac_same_den, ~640 for frac_pm). probe_base.py measures a model's accuracy on each family.
    python examples/math_fractions/make_data.py OUT_DIR [--task T] [--shots K] [--train N] [--test N] [--seed S]
                                                [--format datasets|jsonl]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
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


def frac_pm(rng: random.Random) -> tuple[str, str]:
    """a/b +- c/d with numerators 1-5, denominators 2-6 (about 640 distinct problems)."""
    a, b = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    text = f"What is ${latex(a) if a.denominator > 1 else a}{op}{latex(b) if b.denominator > 1 else b}$?"
    return f"{text} {INSTRUCTION}", latex(value)


def frac_same_den(rng: random.Random) -> tuple[str, str]:
    """a/n + b/n, answer (a+b)/n unreduced: the solved turns show the rule (add the numerators, keep n); math-verify
    compares values, so 4/6, 2/3 and 0.666... style answers all score. About 500 distinct problems (n 3-12)."""
    n = rng.randint(3, 12)
    a, b = rng.randint(1, n - 1), rng.randint(1, n - 1)
    return f"What is $\\frac{{{a}}}{{{n}}}+\\frac{{{b}}}{{{n}}}$? {BOXED}", f"\\frac{{{a + b}}}{{{n}}}"


def dec_add(rng: random.Random) -> tuple[str, str]:
    """x.y + z.w with one decimal digit (answers like 7.3 or 12)."""
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return f"What is ${a / 10:g}+{b / 10:g}$? {BOXED}", f"{(a + b) / 10:g}"


def frac_of_int(rng: random.Random) -> tuple[str, str]:
    """1/k of a multiple of k (an integer answer)."""
    k = rng.randint(2, 9)
    m = k * rng.randint(2, 12)
    return f"What is $\\frac{{1}}{{{k}}}\\times {m}$? {BOXED}", str(m // k)


DEFAULT_TASK = "frac_same_den"
TASKS = {"frac_pm": frac_pm, "frac_same_den": frac_same_den, "dec_add": dec_add, "frac_of_int": frac_of_int}


def messages(text: str, task: str, shots: int = 3) -> list[dict]:
    """The chat prompt: the system line, `shots` solved problems of the same family (a fixed seed, so every prompt
    shows the same ones) as earlier turns, then the question. The solved turns show the reply format (only
    \\boxed{answer}), which the small model does not follow from the instruction alone."""
    ex_rng, out = random.Random(10_000), [{"role": "system", "content": SYSTEM_PROMPT}]
    for _ in range(shots):
        q, answer = TASKS[task](ex_rng)
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]
    return out + [{"role": "user", "content": text}]


def records(n: int, rng: random.Random, seen: set[str], task: str, shots: int) -> list[dict]:
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise SystemExit(f"only {len(seen)} distinct problems found; ask for fewer")
        text, answer = TASKS[task](rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": messages(text, task, shots), "data_source": task,
                    "reward_model": {"style": "rule", "ground_truth": answer}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=384)
    ap.add_argument("--test", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=sorted(TASKS), default=DEFAULT_TASK)
    ap.add_argument("--format", choices=["datasets", "jsonl"], default="datasets",
                    help="datasets: a save_to_disk folder; jsonl: OUT_DIR/train.jsonl and test.jsonl (no `datasets` needed)")
    ap.add_argument("--shots", type=int, default=3, help="solved examples in each prompt (0: system line only)")
    args = ap.parse_args()
    rng, seen = random.Random(args.seed), set()
    test = records(args.test, rng, seen, args.task, args.shots)  # drawn first: no test problem is in train
    train = records(args.train, rng, seen, args.task, args.shots)
    if args.format == "jsonl":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, recs in (("train", train), ("test", test)):
            (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        import datasets
        datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                              "test": datasets.Dataset.from_list(test)}).save_to_disk(args.out)
    print(f"{args.out}: {len(train)} train, {len(test)} test; e.g. {train[0]['prompt'][-1]['content']!r} -> "
          f"{train[0]['reward_model']['ground_truth']!r}")


if __name__ == "__main__":
    main()
