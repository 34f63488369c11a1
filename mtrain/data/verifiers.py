"""Verifier rewards: `math_verify_reward` (HuggingFace math-verify: LaTeX / \\boxed{} answers compared by value) and
`code_exec_reward` (the response's ```python block run against the record's tests in the sandbox; the pass rate).

Both are reward functions in the sense of mtrain/data/rewards.py (reward.fn = "mtrain.data.rewards:math_verify_reward")
and both bound their own time, so that a pathological answer scores 0 instead of stalling the step:
- math: parse + verify run in a worker process (mtrain/data/math_verify_worker.py); past `timeout_s` the caller kills
  it and starts another. math-verify's own signal timeout cannot do this in the trainer's reward threads.
- code: every test is one sandbox run (mtrain/tools/sandbox.py, its default SandboxLimits); a test that runs past the
  wall or CPU limit fails, and the tests after it are not run (they fail too), so one response costs at most one
  limit beyond its passing tests.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import os
import re
import secrets
import select
import subprocess
import sys
import threading
from typing import Any

from mtrain.data.boxed import last_boxed

log = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5.0  # per response: parse of both sides + every comparison
_MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; not counted in a call's bound


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)  # this mtrain, not another
        self.proc = subprocess.Popen([sys.executable, "-m", "mtrain.data.math_verify_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        ready = self._read(_START_TIMEOUT_S)
        if not (ready or {}).get("ready"):
            self.kill()
            raise RuntimeError("the math-verify worker did not start (is math-verify installed? "
                               "pip install 'mtrain[math]')")

    def _read(self, timeout_s: float) -> dict | None:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not r:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, gold: list[str], pred: str, timeout_s: float) -> dict | None:
        """The worker's reply, or None when it did not answer within timeout_s (it is then killed)."""
        inner = max(1, int(timeout_s))  # math-verify's own alarm: whole seconds, a first line inside the bound
        self.proc.stdin.write(json.dumps({"gold": gold, "pred": pred, "timeout": inner}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if reply is None:
            self.kill()
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _WorkerPool:
    """Idle workers, reused; at most _MAX_WORKERS at once (the reward threads wait for one beyond that)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(_MAX_WORKERS)
        self.timeouts = 0

    def check(self, gold: list[str], pred: str, timeout_s: float) -> bool | None:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _Worker()
            try:
                reply = worker.ask(gold, pred, timeout_s)
            except (OSError, ValueError):  # the worker died (e.g. its CPU limit): a fresh one next time
                worker.kill()
                raise RuntimeError("the math-verify worker died") from None
            if reply is None:
                with self._lock:
                    self.timeouts += 1
                return None
            with self._lock:
                self._idle.append(worker)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        return bool(reply["ok"])

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_pool = _WorkerPool()
atexit.register(_pool.close)


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(f"{module} is not installed: pip install 'mtrain[{extra}]'")


_DELIMITED = re.compile(r"\$|\\\(|\\\[|\\boxed")


def _gold_texts(answer: Any) -> list[str]:
    """The reference answers as math-verify input: bare LaTeX ("\\frac{1}{2}") gets $...$ so it parses as LaTeX."""
    items = answer if isinstance(answer, (list, tuple)) else [answer]
    out = []
    for a in items:
        if isinstance(a, float) and math.isfinite(a) and a == int(a):
            a = int(a)  # 3.0 from a parquet float column means 3
        s = str(a).strip()
        out.append(s if _DELIMITED.search(s) else f"${s}$")
    return out


def _prediction_text(response: str) -> str:
    """The last \\boxed{} is the answer (a response that boxes a scratch value first and the result last is judged by
    the result); without one, math-verify's anchored search ("the answer is 12", "final answer: ..."), never a bare
    expression of the text (it may be the question restated: mtrain/data/math_verify_worker.py)."""
    boxed = last_boxed(response)
    return f"$\\boxed{{{boxed}}}$" if boxed is not None else response


def math_verify_reward(response: str, answer: Any, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S, **_: Any) -> float:
    """1.0 when the response's final answer equals `answer` (or one of a list) by math-verify's comparison (sympy
    equivalence: 1/2 = 0.5 = \\frac{2}{4}, sets and intervals, units text stripped), 0.0 when not, when there is no
    answer, or when checking takes longer than timeout_s (the worker is killed: a pathological answer is wrong)."""
    _require("math_verify", "math")
    got = _pool.check(_gold_texts(answer), _prediction_text(response), timeout_s)
    if got is None:
        log.warning("math_verify_reward: check took over %.3g s, scored 0 (%d so far; response starts %r)",
                    timeout_s, _pool.timeouts, response[:80])
        return 0.0
    return 1.0 if got else 0.0


# ---- code -------------------------------------------------------------------------------------------------------

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# The test runs after the solution, in the same namespace; the nonce (on stdin, not in the file) is printed only
# after the test passed, so exiting early with status 0 does not pass. Code that reads the harness's own frames can
# still forge it: the sandbox bounds what code may do, not whether it plays fair.
_HARNESS = """import sys
def _run(nonce, solution, test, stdin_text):
    import io
    ns = {{"__name__": "__main__"}}
    if stdin_text is not None:
        sys.stdin = io.StringIO(stdin_text)
    exec(compile(solution, "solution.py", "exec"), ns)
    if test is not None:
        exec(compile(test, "test.py", "exec"), ns)
    sys.stdout.flush()
    sys.__stdout__.write("\\n" + nonce + "\\n")
_run(sys.stdin.readline().strip(), {solution!r}, {test!r}, {stdin_text!r})
"""


def extract_code(response: str) -> str | None:
    """The last fenced ```python (or bare ```) block of the response; None when there is none."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


def _tests_of(answer: Any) -> list[tuple[str | None, str | None, str | None]]:
    """(test code, stdin, expected stdout) per test. `answer`: a list of test snippets ("assert f(1) == 2"), one
    test string, or stdin/stdout cases {"inputs": [...], "outputs": [...]} (APPS/TACO style), also as a JSON string."""
    if isinstance(answer, str) and answer.lstrip()[:1] in ("{", "["):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError:
            pass
    if isinstance(answer, dict):
        ins, outs = answer.get("inputs"), answer.get("outputs")
        if not (isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) and ins):
            raise ValueError("stdin/stdout tests need 'inputs' and 'outputs' lists of one length")
        return [(None, str(i), str(o)) for i, o in zip(ins, outs)]
    items = answer if isinstance(answer, (list, tuple)) else [answer]
    if not items or not all(isinstance(t, str) and t.strip() for t in items):
        raise ValueError(f"tests must be non-empty strings, got {answer!r}"[:200])
    return [(t, None, None) for t in items]


def _passes(solution: str, test: str | None, stdin_text: str | None, expected: str | None, limits) -> tuple[bool, bool]:
    """(passed, hit a limit) of one test in a fresh sandbox; a limit: the wall clock, or killed by a signal (CPU)."""
    from mtrain.tools.sandbox import run_python

    nonce = secrets.token_hex(16)
    r = run_python(_HARNESS.format(solution=solution, test=test, stdin_text=stdin_text), limits, stdin=nonce + "\n")
    lines = r.stdout.rstrip("\n").split("\n")
    ok = r.ok and not r.truncated and lines[-1] == nonce
    if ok and expected is not None:
        got = "\n".join(lines[:-1]).rstrip("\n")
        ok = [ln.rstrip() for ln in got.strip().split("\n")] == [ln.rstrip() for ln in expected.strip().split("\n")]
    return ok, r.timed_out or (r.exit_code is not None and r.exit_code < 0)


def code_exec_reward(response: str, answer: Any, *, limits: Any = None, **_: Any) -> float:
    """The share of the record's tests (`answer`, see _tests_of) that the response's last ```python block passes,
    each in its own sandbox run under `limits` (default: the sandbox's SandboxLimits). 0.0 without a code block."""
    from mtrain.tools.sandbox import SandboxLimits

    tests = _tests_of(answer)
    code = extract_code(response)
    if code is None or not code.strip():
        return 0.0
    limits = limits or SandboxLimits()
    passed = 0
    for test, stdin_text, expected in tests:
        ok, limited = _passes(code, test, stdin_text, expected, limits)
        passed += ok
        if limited:  # the rest would likely hit it too: one wall (or CPU) limit per response at most
            break
    return passed / len(tests)
