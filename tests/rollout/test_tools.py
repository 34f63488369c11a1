"""Tools for real: the python sandbox's limits (and that nothing is left running), session isolation, the
ToolServer turning every failure into a message, BM25 retrieval, the calculator against Python's own ints."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from mtrain.tools.base import BaseTool, ToolError, ToolSession, check_schema
from mtrain.tools.calculator import CalculatorTool, evaluate
from mtrain.tools.corpus import town_corpus
from mtrain.tools.python_tool import PythonTool
from mtrain.tools.retrieval import RetrievalTool, load_corpus
from mtrain.tools.sandbox import SandboxLimits, processes_of_uid, run_python, sandbox_python
from mtrain.tools.server import ToolServer

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, memory_mb=256, max_procs=8, max_output_chars=200)


def _sandbox_processes() -> list[int]:
    """Every process running a sandbox script (cwd in a mtrain-sandbox-* scratch dir), whatever its group/uid."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if "mtrain-sandbox-" in os.readlink(f"/proc/{d}/cwd"):
                    out.append(int(d))
            except OSError:
                pass
    return out


def _call_python(code: str, limits=LIMITS):
    server = ToolServer([PythonTool(limits)], timeout_s=30)

    async def go():
        async with server.session("s") as s:
            return await server.call(s, "python", {"code": code})
    t = time.monotonic()
    r = asyncio.run(go())
    return r, time.monotonic() - t


def test_sandbox_runs_code_with_a_clean_environment():
    os.environ["MTRAIN_TEST_SECRET"] = "hunter2"
    try:
        r, _ = _call_python("import os, sys\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(2**100)",
                            SandboxLimits(**{**LIMITS.__dict__, "max_output_chars": 2000}))
    finally:
        del os.environ["MTRAIN_TEST_SECRET"]
    assert r.ok, r.content
    assert "hunter2" not in r.content and "MTRAIN_TEST_SECRET" not in r.content
    assert str(2 ** 100) in r.content and "mtrain-sandbox-" in r.content


@pytest.mark.parametrize("name,code,why", [
    ("infinite loop", "while True:\n    pass", ("CPU limit", "killed", "limit")),
    # on a loaded machine the interpreter's start can use up the 2 s wall limit before the allocation: killed by it
    ("memory bomb", "x = bytearray(1 << 34)\nprint('allocated')", ("MemoryError", "limit")),
    ("memory bomb (growing)", "a = []\nwhile True:\n    a.append(' ' * (1 << 20))", ("MemoryError", "killed")),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
     ("limit", "killed")),
    ("sleeping forever", "import time\ntime.sleep(1000)", ("limit",)),
    ("escaping the group", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
                           "time.sleep(1000)", ("limit",)),
])
def test_sandbox_limits_end_in_a_tool_error_and_leave_no_process(name, code, why):
    if name == "escaping the group" and not sandbox_python()[1]:
        pytest.skip("a process that leaves the group is only caught through the sandbox's own uid (root)")
    r, wall = _call_python(code)
    assert not r.ok and r.error_kind == "tool_error", r
    assert any(w in r.content for w in why), r.content
    assert wall < LIMITS.wall_s + 4.0, f"{name} took {wall:.1f} s"
    deadline = time.monotonic() + 2.0
    while _sandbox_processes() and time.monotonic() < deadline:  # killed processes may take a moment to vanish
        time.sleep(0.05)
    left = [p for p in _sandbox_processes() if _state(p) not in ("Z", None)]
    assert left == [], f"{name} left processes {left}"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_sandbox_runs_under_its_own_uid_when_root():
    python, own = sandbox_python()
    r = run_python("import os\nprint(os.getuid())\nopen('/etc/mtrain-sandbox-probe', 'w')", LIMITS)
    if os.geteuid() == 0 and own:
        uid = int(r.stdout.split()[0])
        assert uid != 0 and "PermissionError" in r.stderr
        assert processes_of_uid(uid) == []
    else:
        pytest.skip("not root or no interpreter other users may run: the sandbox keeps the caller's uid")


def test_sandbox_truncates_output_and_reports_exit_codes():
    r = run_python("print('x' * 100000)\nraise SystemExit(3)", LIMITS)
    assert r.truncated and len(r.stdout) == LIMITS.max_output_chars and r.exit_code == 3 and not r.ok


def test_sandbox_timeout_at_the_wall_clock_limit():
    r = run_python("import time\ntime.sleep(30)", SandboxLimits(wall_s=1.0))
    assert r.timed_out and r.exit_code is None and 1.0 <= r.wall_s < 4.0


class Notebook(BaseTool):
    """A stateful tool: notes live in the session, never on the tool."""
    schema = {"type": "function", "function": {"name": "notebook", "parameters": {"type": "object", "properties": {
        "write": {"type": "string"}}}}}

    def __init__(self):
        self.released = []

    def create(self, session):
        return []

    def call(self, session, args):
        if "write" in args:
            session.state["notebook"].append(args["write"])
        return json.dumps(session.state["notebook"])

    def calc_reward(self, session):
        return float(len(session.state["notebook"]))

    def release(self, session):
        self.released.append(session.id)


def test_two_concurrent_sessions_cannot_see_each_other():
    nb = Notebook()
    server = ToolServer([nb, RetrievalTool(top_k=1)])

    async def agent(name, secret, gate_in, gate_out):
        async with server.session(name) as s:
            await server.call(s, "notebook", {"write": secret})
            await server.call(s, "search", {"query": f"query of {name}"})
            gate_out.set()
            await gate_in.wait()  # both sessions are open and written before either reads
            seen = (await server.call(s, "notebook", {})).content
            return json.loads(seen), s.state["search"]["queries"], server.calc_reward(s)["notebook"]

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(agent("A", "alpha", b, a), agent("B", "beta", a, b))
    (notes_a, q_a, r_a), (notes_b, q_b, r_b) = asyncio.run(main())
    assert notes_a == ["alpha"] and notes_b == ["beta"]
    assert q_a == ["query of A"] and q_b == ["query of B"]
    assert r_a == r_b == 1.0
    assert sorted(nb.released) == ["A", "B"] and server.open_sessions == []


def test_server_turns_every_failure_into_a_message():
    class Slow(BaseTool):
        schema = {"type": "function", "function": {"name": "slow", "parameters": {"type": "object", "properties": {}}}}

        def call(self, session, args):
            time.sleep(2)
            return "late"

    class Refuses(BaseTool):
        schema = {"type": "function", "function": {"name": "refuses", "parameters": {"type": "object",
                                                                                    "properties": {}}}}

        def call(self, session, args):
            raise ToolError("no such thing")

    server = ToolServer([CalculatorTool(), Slow(), Refuses()], timeout_s=0.3, max_output_chars=50)

    async def main():
        async with server.session("s") as s:
            return [await server.call(s, n, a) for n, a in [
                ("nope", {}), ("calculator", "{not json"), ("calculator", {"expr": "1"}),
                ("calculator", {"expression": 5}), ("calculator", {"expression": "1/0"}), ("slow", {}),
                ("refuses", {}), ("calculator", {"expression": "7**300"}),
                ("calculator", '"{\\"expression\\": \\"6*7\\"}"')]]
    res = asyncio.run(main())
    kinds = [r.error_kind for r in res]
    assert kinds == ["unknown_tool", "bad_arguments", "bad_arguments", "bad_arguments", "tool_error", "timeout",
                     "tool_error", None, "bad_arguments"]
    assert "division by zero" in res[4].content and "timed out after 0.3 s" in res[5].content
    assert res[7].ok and "truncated" in res[7].content and res[7].content.startswith(str(7 ** 300)[:50])
    assert server.open_sessions == []


def test_release_runs_on_errors_and_create_failures():
    nb = Notebook()

    class BadCreate(BaseTool):
        schema = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {}}}}

        def create(self, session):
            raise RuntimeError("cannot create")

        def call(self, session, args):
            return ""
    server = ToolServer([nb, BadCreate()])
    with pytest.raises(RuntimeError, match="cannot create"):
        server.create_session("x")
    assert nb.released == ["x"] and server.open_sessions == []

    server = ToolServer([nb])

    async def fails():
        async with server.session("y"):
            raise KeyError("boom")
    with pytest.raises(KeyError):
        asyncio.run(fails())

    async def cancelled():
        async with server.session("z"):
            await asyncio.sleep(10)
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(cancelled(), 0.1))
    assert nb.released == ["x", "y", "z"] and server.open_sessions == []
    with pytest.raises(ValueError, match="already open"):
        s = server.create_session("w")
        server.create_session("w")
    server.release_session(s)
    server.release_session(s)  # idempotent
    assert nb.released.count("w") == 1


def test_schemas_are_checked():
    with pytest.raises(ValueError, match="type': 'function"):
        check_schema({"name": "x"})
    with pytest.raises(ValueError, match="required parameter 'b'"):
        check_schema({"type": "function", "function": {"name": "x", "parameters": {
            "type": "object", "properties": {"a": {}}, "required": ["b"]}}})
    with pytest.raises(ValueError, match="two tools named"):
        ToolServer([CalculatorTool(), CalculatorTool()])


def test_retrieval_finds_the_document_of_every_question():
    docs, questions = town_corpus(n_towns=60, seed=3)
    tool = RetrievalTool(docs, top_k=1)
    for q in questions:
        (i, score), = tool.search(q.question)
        assert q.town in docs[i] and q.answer in docs[i] and score > 0
    assert tool.search("the of is") == []  # stopwords only
    assert town_corpus(n_towns=60, seed=3) == (docs, questions)  # deterministic


def test_retrieval_corpus_files(tmp_path):
    (tmp_path / "c.txt").write_text("alpha beta\n\ngamma delta\n")
    (tmp_path / "c.jsonl").write_text('{"text": "alpha beta"}\n{"text": "gamma delta"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    assert load_corpus(tmp_path / "c.txt") == load_corpus(tmp_path / "c.jsonl") == ["alpha beta", "gamma delta"]
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_corpus(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing.txt")
    assert RetrievalTool(load_corpus(tmp_path / "c.txt")).search("gamma")[0][0] == 1


def test_calculator_is_exact_against_python_ints():
    import random
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.randint(-10 ** 12, 10 ** 12) for _ in range(3))
        assert evaluate(f"{a}*{b}+{c}") == a * b + c
        assert evaluate(f"({a}-{c})*({b})") == (a - c) * b
    assert evaluate("2^10") == 1024 and evaluate("7/2") == 3.5 and evaluate("8/2") == 4
    for bad in ["__import__('os')", "a+1", "2**100000", "9**9**9", "1/0", "", "x" * 600]:
        with pytest.raises(ToolError):
            evaluate(bad)


def test_a_lone_surrogate_in_code_is_the_models_code_not_a_crash():
    """JSON's "\\ud800" in a tool call's arguments decodes to a lone surrogate, which UTF-8 cannot encode: the
    script is written with it escaped, so the call runs (a string literal keeps its meaning)."""
    server = ToolServer([PythonTool(LIMITS)], timeout_s=30)

    async def go():
        async with server.session("s") as s:
            return await server.call(s, "python", '{"code": "x = \'\\ud800\'\\nprint(len(x), hex(ord(x)))"}')
    r = asyncio.run(go())
    server.close()
    assert r.ok and r.content == "1 0xd800", (r.error_kind, r.content)


def test_a_failed_scratch_directory_releases_the_sandbox_uid(monkeypatch):
    import tempfile

    from mtrain.tools import sandbox
    if not sandbox_python()[1]:
        pytest.skip("not root: no sandbox uid to release")

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    for _ in range(3):
        with pytest.raises(OSError, match="No space"):
            run_python("print(1)", LIMITS)
    assert not sandbox._uids_in_use
