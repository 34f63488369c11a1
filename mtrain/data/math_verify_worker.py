"""A worker process that runs math-verify's parse + verify: `python -m mtrain.data.math_verify_worker`.

Why a process: math-verify's own timeout is signal.alarm, which only works in the main thread (called from any other
thread, as the trainer calls rewards, `parse` raises ValueError), and a signal cannot interrupt a long computation
inside C code (sympy evaluating `\\boxed{10!!!!!}` never returns to the interpreter). Here the worker's main thread
runs the check with math-verify's own timeouts (a cheap first line), and the caller kills the whole process when
its hard bound passes (mtrain/data/verifiers.py).

Protocol: one JSON line per request on stdin {"gold": [str], "pred": str, "timeout": int}; one JSON line per answer
on stdout {"ok": bool} or {"error": str}. The first line written is {"ready": true} once math-verify is imported.
"""
from __future__ import annotations

import json
import logging
import sys


def check(gold: list[str], pred: str, timeout: int) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # The response: an answer it marks (\boxed{}, "the answer is ...") only. Unanchored, math-verify takes any
    # expression of the text, and a response that restates the question ("$\frac{5}{2}-\frac{3}{5}$ can be rewritten
    # ...") would score by the question's value.
    anchored = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
                ExprExtractionConfig(try_extract_without_anchor=False)]
    parsed_pred = parse(pred, extraction_config=anchored, parsing_timeout=timeout)
    if not parsed_pred:
        return False
    return any(verify(parse(g, parsing_timeout=timeout), parsed_pred, timeout_seconds=timeout) for g in gold)


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify logs each failed parse; the reward is the report
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but protocol lines on the real stdout
    import math_verify  # noqa: F401 - import cost paid before "ready", not inside a call's time bound

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"ok": bool(check(list(req["gold"]), str(req["pred"]), int(req["timeout"])))}
        except Exception as e:  # noqa: BLE001 - one bad request must not end the worker
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
