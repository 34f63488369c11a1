"""Tool calls through the front: a tiny Llama taught (a few seconds of CPU) to call the calculator for one question
and answer with its result drives the example agent (written only against the `openai` client) to reward 1; the
session's recorded trajectory is the exact token sequence it was taught (prompt, call, tool reply, answer)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from scripted_model import CONFIG, script_tokens, train_scripted_model  # noqa: E402

from front_fixtures import MODEL, chatml_tokenizer  # noqa: E402
from mtrain.rollout import ReferenceEngine  # noqa: E402
from mtrain.rollout.agents.calculator_agent import TOOLS, make_calculator_agent  # noqa: E402
from mtrain.rollout.client import LocalClient  # noqa: E402
from mtrain.rollout.reference_engine import hf_disk_views  # noqa: E402
from mtrain.serve.front import OpenAIFront  # noqa: E402
from mtrain.serve.server import FrontServer  # noqa: E402

QUESTION = "What is 12*4?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*4"}}\n</tool_call>'


@pytest.fixture(scope="module")
def taught():
    tok = chatml_tokenizer()
    seq = script_tokens(tok, QUESTION, [CALL, "48"], [[{"role": "tool", "content": "48"}]], tools=TOOLS)
    model = train_scripted_model([seq], steps=300)
    engine = ReferenceEngine(CONFIG)
    views = hf_disk_views(model)
    engine.update_weights([[(k, v.detach().clone()) for k, v in views.items() if k in engine.parameter_specs()]])
    engine.finish_weight_update(1)
    front = OpenAIFront(LocalClient(engine), tok, model_name=MODEL, max_positions=512, tool_parser="qwen25")
    with FrontServer(front) as srv:
        yield srv, tok, seq
    engine.shutdown()


def test_tool_call_is_parsed_and_the_agent_loop_is_recorded_exactly(taught):
    srv, tok, (ids, mask) = taught
    c = OpenAI(base_url=srv.base_url, api_key=srv.api_key)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                  temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content, repr(ch.message.content)
    assert [(t.function.name, t.function.arguments) for t in ch.message.tool_calls] == [
        ("calculator", '{"expression": "12*4"}')]
    # streaming gives the same call as a tool_calls delta
    deltas = [d for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                        tools=TOOLS, temperature=0, max_tokens=120, stream=True)
              for d in chunk.choices]
    calls = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("calculator", '{"expression": "12*4"}')]
    assert deltas[-1].finish_reason == "tool_calls"
    # tool_choice="none": no tools in the prompt, the call text comes back as plain content
    plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                      tool_choice="none", temperature=0, max_tokens=10)
    assert plain.choices[0].message.tool_calls is None

    sid = srv.front.sessions.create().id
    agent = make_calculator_agent(MODEL, temperature=0, max_tokens=120)
    reward = asyncio.run(agent(f"{srv.url}/sessions/{sid}/v1", srv.api_key, {"question": QUESTION, "answer": "48"}))
    assert reward == 1.0
    s = srv.front.sessions.get(sid)
    assert (s.calls, len(s.leaves()), s.summary()["rerendered"]) == (2, 1, 0)
    traj = s.leaves()[0].trajectory
    assert [seg.kind for seg in traj.segments] == ["prompt", "model", "env", "model"]
    assert traj.tokens == ids  # exactly the sequence the model was taught, token for token
    assert traj.loss_mask == mask
    assert tok.decode(traj.segments[1].ids, skip_special_tokens=True) == CALL
    assert all(v == 1 for seg in traj.segments if seg.kind == "model" for v in seg.versions)
