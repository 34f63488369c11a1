"""Write the calculator task as prompt files for `mtrain train` (data.train_path / data.eval_path of config.yaml):
one JSON record per line, {"prompt": [chat messages: the worked example, then the question], "answer": "product",
"pair": [a, b]}. The committed examples/smollm2_tools/data/*.jsonl are this script's output with the defaults
(the same 48 training and 32 held-out problems as train_tool_use.py's run in docs/archive/results-2026-11.md section 16).

    python examples/smollm2_tools/make_data.py [--train 48] [--eval 32] [--out examples/smollm2_tools/data]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from calculator_task import splits


def write(samples, path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"prompt": s.prompt, "answer": s.answer, **s.metadata}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=48)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    a = ap.parse_args()
    train, evals = splits(a.train, a.eval)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write(train, out / "train.jsonl")
    write(evals, out / "eval.jsonl")
    print(f"wrote {len(train)} training and {len(evals)} held-out problems to {out}")


if __name__ == "__main__":
    main()
