"""How well a judge model's verdicts agree with exact match on two-number addition, and how fast it judges.

The judge is `mtrain.rollout.judge.JudgeReward` exactly as a run builds it (`make_judge` from a config with a
reward.judge section, examples/judge/grpo_judge.yaml), on the CPU reference engine. Candidate answers: for each
problem "What is a + b?" the correct sum and a wrong one (sum + d, d in +-1..10), so half the verdicts should be
"yes". Reports agreement with exact match, the yes rate on correct and on wrong answers (a judge that says yes to
everything scores 50 %), unparsed verdicts, and judge calls per second, for each of `--seeds` problem sets.

    PYTHONPATH=$PWD python benchmarks/judge_agreement.py --problems 48 --seeds 3
    (judge: SmolLM2-135M-Instruct from mtrain.converters.smollm2, unless --judge PATH)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "judge" / "grpo_judge.yaml"


def pairs(n: int, seed: int) -> list[tuple[str, str, str, bool]]:
    """(prompt, response, answer, correct): n problems, each with its right answer and one wrong answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        prompt = f"What is {a} + {b}? Answer with just the number."
        wrong = a + b + rng.choice([d for d in range(-10, 11) if d and a + b + d >= 0])
        out += [(prompt, str(a + b), str(a + b), True), (prompt, str(wrong), str(a + b), False)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default=None, help="HF dir of the judge (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--problems", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. reward.judge.template='...'")
    args = ap.parse_args()

    import torch
    from mtrain.config import load_config
    from mtrain.rollout.judge_engine import load_judge_tokenizer, make_judge, start_judge_engine

    judge_dir = args.judge
    if judge_dir is None:
        from mtrain.converters.smollm2 import smollm2_hf_dir
        judge_dir = str(smollm2_hf_dir())
    cfg = load_config(str(EXAMPLE), [f"model.hf_path={judge_dir}", f"reward.judge.hf_path={judge_dir}",
                                       *args.overrides])
    engine = start_judge_engine(judge_dir, engine_kind="reference", engine_dtype=torch.float32,
                                mem_fraction_static=cfg.reward.judge.mem_fraction_static)
    judge = make_judge(cfg, engine, load_judge_tokenizer(judge_dir))
    runs = []
    try:
        for seed in range(args.seeds):
            data = pairs(args.problems, seed)
            t0 = time.perf_counter()
            verdicts = judge.judge([p for p, *_ in data], [r for _, r, *_ in data], [a for *_, a, _ in data])
            wall = time.perf_counter() - t0
            m = judge.pop_metrics()
            right = [v for v, d in zip(verdicts, data) if d[3]]
            wrong = [v for v, d in zip(verdicts, data) if not d[3]]
            runs.append({"seed": seed, "calls": len(data),
                         "agreement": sum((v >= 0.5) == d[3] for v, d in zip(verdicts, data)) / len(data),
                         "yes_on_correct": sum(right) / len(right), "yes_on_wrong": sum(wrong) / len(wrong),
                         "unparsed": m["judge/unparsed"] / len(data), "calls_per_s": len(data) / wall,
                         "examples": judge.last_verdicts[:4]})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        engine.shutdown()
    summary = {k: (statistics.mean(r[k] for r in runs), statistics.pstdev(r[k] for r in runs))
               for k in ("agreement", "yes_on_correct", "yes_on_wrong", "unparsed", "calls_per_s")}
    print("summary (mean, std over seeds):", json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"judge": judge_dir, "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
