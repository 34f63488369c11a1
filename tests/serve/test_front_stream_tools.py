"""Tool calls in a streamed chat: a tiny Llama taught (a few seconds of CPU) to say some text and then call the
calculator. The text before the call streams as content, the call markup never does; the call comes as `tool_calls`
deltas that the openai client's own stream accumulator (`chat.completions.stream`) assembles into the same message
as the non-streamed call."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from scripted_model import script_tokens, train_scripted_engine  # noqa: E402

from front_fixtures import MODEL, chatml_tokenizer  # noqa: E402
from mtrain.rollout.agents.calculator_agent import TOOLS  # noqa: E402
from mtrain.rollout.client import LocalClient  # noqa: E402
from mtrain.serve.front import OpenAIFront  # noqa: E402
from mtrain.serve.server import FrontServer  # noqa: E402

QUESTION = "What is 7*6?"
SAID = "Let me compute that."
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*6"}}\n</tool_call>'
STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]  # what .stream() insists on


@pytest.fixture(scope="module")
def taught():
    tok = chatml_tokenizer()
    seq = script_tokens(tok, QUESTION, [SAID + "\n" + CALL], [], tools=STRICT_TOOLS)
    engine = train_scripted_engine([seq], steps=300)
    front = OpenAIFront(LocalClient(engine), tok, model_name=MODEL, max_positions=512, tool_parser="qwen25")
    with FrontServer(front) as srv:
        yield srv
    engine.shutdown()


def test_tool_calls_stream_as_deltas_and_assemble_to_the_non_streamed_message(taught):
    c = OpenAI(base_url=taught.base_url, api_key=taught.api_key, max_retries=0)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=STRICT_TOOLS, temperature=0,
              max_tokens=120)
    full = c.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == SAID
    contents, call_chunks = [], 0
    with c.chat.completions.stream(**kw) as s:
        for event in s:
            if event.type == "chunk":
                for ch in event.chunk.choices:
                    contents.append(ch.delta.content or "")
                    call_chunks += bool(ch.delta.tool_calls)
        final = s.get_final_completion().choices[0]
    assert all("<" not in piece and "{" not in piece for piece in contents)  # markup never streams as content
    assert sum(bool(p) for p in contents) > 1 and "".join(contents) == SAID  # the text streamed, in pieces
    assert call_chunks >= 1 and final.finish_reason == "tool_calls"
    assert final.message.content == full.message.content
    assert [(t.type, t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        (t.type, t.function.name, t.function.arguments) for t in full.message.tool_calls] == [
        ("function", "calculator", '{"expression": "7*6"}')]
