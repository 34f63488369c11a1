"""Malformed model output is the model's mistake: a tool call nested 5,000 deep, an integer of 5,000 digits, or
260 KB of unclosed <tool_call> tags becomes a tool error message for the model, in time linear in the text, and
never an exception out of the parser, the tool server or the rollout's turn (which would fail the whole group).
Real parsers, the real ToolServer and calculator, the rollout's own `_run_calls`."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from mtrain.rollout.agents.multi_turn import _run_calls
from mtrain.tools.calculator import CalculatorTool
from mtrain.tools.parsers import MAX_JSON_DEPTH, ToolCallParser
from mtrain.tools.server import ToolServer

DEEP = "[" * 5000 + "]" * 5000
DEEP_ARGS = '{"name": "calculator", "arguments": {"expression": ' + DEEP + "}}"
BIG_INT = '{"name": "calculator", "arguments": {"expression": ' + "7" * 5000 + "}}"
HOSTILE = {
    "qwen25": {"deep": f"<tool_call>\n{DEEP}\n</tool_call>", "deep_args": f"<tool_call>\n{DEEP_ARGS}\n</tool_call>",
               "big_int": f"<tool_call>\n{BIG_INT}\n</tool_call>", "unclosed": "<tool_call>\n" * 21_700},
    "hermes": {"deep": f"<tool_call>{DEEP}</tool_call>", "deep_args": f"<tool_call>{DEEP_ARGS}</tool_call>",
               "big_int": f"<tool_call>{BIG_INT}</tool_call>", "unclosed": "<tool_call>x" * 21_700},
}
CASES = [(p, k) for p in HOSTILE for k in HOSTILE[p]]


@pytest.mark.parametrize("parser_name,kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_hostile_tool_call_is_a_tool_error_message_in_bounded_time(parser_name, kind):
    text = HOSTILE[parser_name][kind]
    assert len(text) > 5_000
    server = ToolServer([CalculatorTool()], timeout_s=5)
    parser = ToolCallParser(parser_name, server.schemas)
    ctx = SimpleNamespace(tools=server, max_tool_calls_per_turn=4)

    async def turn():
        async with server.session("s") as s:
            return await _run_calls(ctx, s, parsed)
    t0 = time.perf_counter()
    parsed = parser.parse(text)
    results = asyncio.run(turn())
    took = time.perf_counter() - t0
    assert took < 1.0, f"{took:.2f} s for {len(text)} characters"  # the unclosed case took 29 s before
    assert parsed.calls == [] and parsed.attempted >= 1
    assert results and all(not r.ok and r.content.startswith("Error:") for _, r in results), results
    assert len(results[0][1].content) < 2_000  # the message names the problem, it does not echo the text


def test_parse_time_grows_linearly_with_unclosed_tags():
    parser = ToolCallParser("qwen25", ToolServer([CalculatorTool()]).schemas, backend="mtrain")
    times = []
    for n in (20_000, 80_000):
        t0 = time.perf_counter()
        r = parser.parse("<tool_call>\n" * n)
        times.append(time.perf_counter() - t0)
        assert r.calls == [] and "unclosed" in r.malformed[-1][1]
    assert times[1] < 0.5 and times[1] < 16 * max(times[0], 1e-3), times  # quadratic would be 16x


def test_json_at_the_depth_limit_still_parses_and_one_deeper_is_malformed():
    parser = ToolCallParser("qwen25", ToolServer([CalculatorTool()]).schemas, backend="mtrain")
    inner = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)  # + the call object and its arguments object
    ok = parser.parse('<tool_call>\n{"name": "calculator", "arguments": {"x": ' + inner + "}}\n</tool_call>")
    assert [c.name for c in ok.calls] == ["calculator"]
    bad = parser.parse('<tool_call>\n{"name": "calculator", "arguments": {"x": [' + inner + "]}}\n</tool_call>")
    assert bad.calls == [] and "nested deeper than" in bad.malformed[0][1]
    # brackets inside strings (escaped quotes included) do not count
    s = '"' + '\\"[' * 500 + '"'
    ok = parser.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": ' + s + "}}\n</tool_call>")
    assert [c.name for c in ok.calls] == ["calculator"]


@pytest.mark.parametrize("arguments", ['{"expression": ' + DEEP + "}", '{"expression": ' + "9" * 5000 + "}"])
def test_tool_server_refuses_hostile_arguments_as_bad_arguments(arguments):
    server = ToolServer([CalculatorTool()], timeout_s=5)

    async def main():
        async with server.session("s") as s:
            return await server.call(s, "calculator", arguments)
    r = asyncio.run(main())
    assert not r.ok and r.error_kind == "bad_arguments" and r.content.startswith("Error: arguments of calculator")
