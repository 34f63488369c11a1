"""math_verify_reward on a table of answer pairs, its hard time bound (in the main thread and in a reward thread), and
code_exec_reward in the real sandbox with correct, wrong, crashing, looping and hostile code."""
import threading
import time

import pytest

pytest.importorskip("math_verify")

from mtrain.data.rewards import code_exec_reward, load_reward_fn, math_verify_reward, safe_reward  # noqa: E402
from mtrain.tools.sandbox import SandboxLimits  # noqa: E402

# (response, reference answer, expected reward): equivalence by value, not by string.
MATH_TABLE = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),  # \frac vs decimal, boxed inside prose
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),  # unreduced fraction
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{0.333}", "\\frac13", 0.0),  # close is not equal
    ("\\boxed{-7}", "7", 0.0),
    ("\\boxed{3.0}", 3, 1.0),  # a number column
    ("\\boxed{3.0}", 3.0, 1.0),
    ("\\boxed{[1, 2)}", "[1,2)", 1.0),  # intervals
    ("\\boxed{(1, 2]}", "[1,2)", 0.0),
    ("\\boxed{(-\\infty, 2]}", "(-\\infty,2]", 1.0),
    ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1.0),  # sets: order does not matter
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units text
    ("\\boxed{5 \\text{ meters}}", "5", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2x+2}", "2(x+1)", 1.0),  # symbolic equivalence
    ("\\boxed{2x+1}", "2(x+1)", 0.0),
    ("\\boxed{x=3}", "3", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("So we get $x = 3$, thus \\boxed{3}", "3", 1.0),
    ("the answer is 12", "12", 1.0),  # no box: math-verify's anchored answer search
    ("The final answer is $\\frac{3}{4}$", "0.75", 1.0),
    ("$\\frac{5}{2}-\\frac{3}{5}$ can be rewritten by multiplying", "\\frac{19}{10}", 0.0),  # the question restated
    ("we get $x = 3$ and then", "3", 0.0),  # an unmarked intermediate value is not the answer
    ("I don't know.", "3", 0.0),  # no answer
    ("", "3", 0.0),
    ("first \\boxed{2} then \\boxed{4}", "4", 1.0),  # several boxed: the last is the answer
    ("first \\boxed{4} then \\boxed{2}", "4", 0.0),
    ("\\boxed{4}", ["3", "4"], 1.0),  # any of several references
    ("\\boxed{$\\frac{1}{2}$}", "$\\frac{1}{2}$", 1.0),  # references already delimited
]


@pytest.mark.parametrize("response,answer,expected", MATH_TABLE)
def test_math_verify_table(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


def test_loadable_by_spec_and_through_safe_reward_in_a_thread():
    fn = load_reward_fn("mtrain.data.rewards:math_verify_reward")
    box = {}
    # safe_reward with a timeout calls from a daemon thread: math-verify alone raises ValueError there (signal.alarm)
    t = threading.Thread(target=lambda: box.update(v=safe_reward(fn, "\\boxed{\\frac{6}{8}}", "0.75", timeout_s=60)))
    t.start()
    t.join(90)
    assert box == {"v": 1.0}


PATHOLOGICAL = "\\boxed{10!!!!!}"  # sympy computes (10!)!...: minutes without a bound


@pytest.mark.parametrize("in_thread", [False, True])
@pytest.mark.parametrize("timeout_s", [0.5, 1.5])
def test_pathological_answer_returns_within_the_bound(in_thread, timeout_s):
    """1.5 s: math-verify's own alarm (1 s, in the worker's main thread) ends the check and the worker lives on;
    0.5 s: the bound passes before that alarm, the caller kills the worker (the path a C-level stall takes)."""
    from mtrain.data import verifiers
    math_verify_reward("\\boxed{1}", "1")  # the worker is started: its import time is not in the bound
    kills = verifiers._pool.timeouts
    box = {}

    def call():
        t0 = time.monotonic()
        box["v"] = math_verify_reward(PATHOLOGICAL, "5", timeout_s=timeout_s)
        box["t"] = time.monotonic() - t0

    if in_thread:
        t = threading.Thread(target=call)
        t.start()
        t.join(30)
    else:
        call()
    assert box["v"] == 0.0
    assert box["t"] < timeout_s + 1.0
    assert verifiers._pool.timeouts - kills == (1 if timeout_s < 1 else 0)
    assert math_verify_reward("\\boxed{\\frac{1}{4}}", "0.25") == 1.0  # the next call works (fresh worker or same)


def test_concurrent_calls_agree_with_serial():
    rows = MATH_TABLE[:12]
    results = [None] * len(rows)

    def work(i):
        results[i] = math_verify_reward(rows[i][0], rows[i][1])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [r[2] for r in rows]


# ---- code ---------------------------------------------------------------------------------------------------------

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15", "assert add(0, 0) == 0"]
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256)


def block(code):
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


@pytest.mark.parametrize("code,expected", [
    ("def add(a, b):\n    return a + b", 1.0),
    ("def add(a, b):\n    return a + b if a >= 0 else 5", 0.75),  # wrong on one test of four
    ("def add(a, b):\n    return a * b", 0.25),  # right only on add(0, 0)
    ("def add(a, b):\n    raise RuntimeError('boom')", 0.0),  # crashes
    ("raise SystemExit(0)", 0.0),  # exits with status 0 before the tests run: not a pass
    ("import os\nos._exit(0)", 0.0),
    ("print('PASS ' * 3)\ndef add(a, b):\n    return a - b", 0.25),  # printing 'PASS' passes nothing: add(0, 0) only
    ("def add(a, b):\n    return a + b\nimport sys\nsys.exit(0)", 0.0),  # the tests never run
    ("x = [1] * (10 ** 10)\ndef add(a, b):\n    return a + b", 0.0),  # past the memory limit
])
def test_code_exec_pass_rate(code, expected):
    assert code_exec_reward(block(code), TESTS, limits=LIMITS) == pytest.approx(expected)


def test_code_exec_infinite_loop_is_bounded():
    t0 = time.monotonic()
    r = code_exec_reward(block("while True:\n    pass"), TESTS, limits=LIMITS)
    assert r == 0.0
    assert time.monotonic() - t0 < LIMITS.wall_s + 5  # one test's limit, not four


def test_code_exec_hostile_code_leaves_nothing(tmp_path):
    marker = tmp_path / "owned"
    hostile = (f"import os, subprocess\nopen({str(marker)!r}, 'w').write('x')\n"
               "subprocess.Popen(['sleep', '300'])\nos.fork()\ndef add(a, b):\n    return a + b")
    code_exec_reward(block(hostile), TESTS[:1], limits=LIMITS)
    import os
    if os.geteuid() == 0:  # a sandbox uid of its own: the trainer's folders are not writable
        assert not marker.exists()
    sleepers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == "sleep\x00300\x00"]
    assert sleepers == []


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_code_exec_stdin_stdout_cases_and_json_string():
    cases = '{"inputs": ["1 2\\n", "5 7\\n"], "outputs": ["3\\n", "12\\n"]}'
    right = block("a, b = map(int, input().split())\nprint(a + b)")
    wrong = block("a, b = map(int, input().split())\nprint(a * b)")
    assert code_exec_reward(right, cases, limits=LIMITS) == 1.0
    assert code_exec_reward(wrong, cases, limits=LIMITS) == 0.0


def test_code_exec_no_block_and_bad_tests():
    assert code_exec_reward("def add(a, b): return a + b", TESTS, limits=LIMITS) == 0.0
    with pytest.raises(ValueError, match="non-empty strings"):
        code_exec_reward(block("pass"), [], limits=LIMITS)
    with pytest.raises(ValueError, match="inputs"):
        code_exec_reward(block("pass"), {"inputs": ["1"]}, limits=LIMITS)
