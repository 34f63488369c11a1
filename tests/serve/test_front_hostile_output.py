"""Model output is hostile input to the front: a tool call whose JSON writes a lone surrogate ("\\ud800", which
`json.loads` decodes to a code point UTF-8 cannot encode) is answered, streamed or not, as the same JSON value,
and the next call is served. A client stands in for the engine so the model's text is exactly the hostile one."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from front_fixtures import MODEL, chatml_tokenizer
from mtrain.rollout.protocol import Completion, TokenDelta
from mtrain.serve.front import OpenAIFront
from mtrain.serve.server import FrontServer
from mtrain.tools.parsers import ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
HOSTILE = '<tool_call>\n{"name": "f", "arguments": {"a": "x\\ud800y", "\\udfff": 1}}\n</tool_call>'


class Says:
    """An engine client whose model always answers `text` (streamed token by token through the hook)."""
    weight_version = 0

    def __init__(self, tok, text: str):
        self.ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    async def generate(self, req):
        if req.on_tokens is not None:
            for i in self.ids:
                req.on_tokens(TokenDelta([i], [-0.5]))
                await asyncio.sleep(0)
        return Completion(req.rid, list(req.prompt_ids), list(self.ids), [-0.5] * len(self.ids), "stop", 0)

    def abort(self, rid_prefix=None):
        pass


@pytest.mark.parametrize("backend", ["qwen25", "hermes"])
def test_parsed_arguments_are_text_utf8_can_encode(backend):
    (call,) = ToolCallParser(backend, TOOLS, backend="mtrain").parse(HOSTILE).calls
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"a": "x\ud800y", "\udfff": 1}


@pytest.fixture(scope="module")
def server():
    tok = chatml_tokenizer()
    front = OpenAIFront(Says(tok, HOSTILE), tok, model_name=MODEL, max_positions=512, default_max_tokens=200,
                        tool_parser="qwen25")
    srv = FrontServer(front)
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_with_a_lone_surrogate_is_answered(server, stream):
    h = {"Authorization": f"Bearer {server.api_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": stream}
    for _ in range(2):  # and the next call is served
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text[:300]
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            assert not [e for e in events if "error" in e], events
            calls = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or []]
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"a": "x\ud800y", "\udfff": 1}]
