"""Routing replay asks the engine only for the rows its caller lacks (SGLang's `routed_experts_start_len`).

Checked on the CPU reference engine recording its own router (tiny Qwen3-MoE / DeepSeek-V3): a request with start s
returns exactly rows s.. of the start-0 request, bit for bit; a multi-turn tool trajectory (a tiny Qwen3-MoE taught
to call the calculator, scripted_model.py), a trajectory resumed mid-turn and a partial-rollout sample resumed after an
abort end with the same routing as today's start-0 requests (a client that forces start 0 is the reference), every
request after the first asks from the first position its caller lacked, and the engine sends each row once
(`routing_rows_received`). Also: the merge places rows at their start and refuses a gap; bad starts give one clear
error; the SGLang wire on payload-shaped data (SGLang cannot run here).
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import time

import numpy as np
import pytest
import torch

from mtrain.data import CharTokenizer, PromptSample
from mtrain.rollout.client import LocalClient, RecordingClient
from mtrain.rollout.protocol import Completion, EngineError, Request, SamplingParams
from mtrain.rollout.routing import RoutingError, RoutingShape, merge_resumed, received_bytes, routing_shape
from mtrain.tiny_configs import tiny_config

TOK = CharTokenizer(128)
MOE = dict(tiny_config("qwen3_moe"), vocab_size=128, max_position_embeddings=512)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
QUESTION = "What is 6*7?"


class FromZero(RecordingClient):
    """Today's behaviour, the reference: every request asks for all of its rows, whatever its caller holds."""

    async def generate(self, request):
        return await super().generate(dataclasses.replace(request, routed_experts_start=0))


def _payload(arr) -> str:
    return base64.b64encode(np.asarray(arr, dtype=np.int32).tobytes()).decode()


def test_bad_starts_give_one_clear_error():
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="routed_experts_start"):
            Request("a", [1, 2, 3], routed_experts_start=bad)
    Request("a", [1, 2, 3], routed_experts_start=3)  # the whole prompt held: only the generated tokens' rows
    from mtrain.rollout.reference_engine import ReferenceEngine
    engine = ReferenceEngine(MOE, record_routing=True)
    req = Request("late-", [5, 6, 7], SamplingParams(max_new_tokens=2))
    req.routed_experts_start = 9  # changed after it was built: the engine refuses it before any work
    with pytest.raises(EngineError, match=r"routed_experts_start 9 is outside \[0, 3\]"):
        engine.submit(req).result()
    engine.shutdown()
    with pytest.raises(ValueError, match="routed_experts_start 4 is outside"):
        Completion("c", [1, 2, 3], [4], [0.0], "stop", 0, routed_experts_start=4)
    with pytest.raises(ValueError, match=r"cover 3 tokens, expected prompt \+ output - 1 - start = 2 \(start 1\)"):
        Completion("c", [1, 2, 3], [4], [0.0], "stop", 0, routed_experts=torch.zeros(3, 2, 2, dtype=torch.uint8),
                   routed_experts_start=1)
    from mtrain.trainer.batch import build_batch
    part = Completion("c", [1, 2, 3], [4], [0.0], "stop", 0, routed_experts=torch.zeros(2, 2, 2, dtype=torch.uint8),
                      routed_experts_start=1)
    with pytest.raises(ValueError, match="from position 1 on, not a whole sample's"):
        build_batch([part], [0.0], pad_id=0)


def test_sglang_wire_asks_from_the_start_and_checks_the_rows():
    from mtrain.rollout.sglang_wire import completion_from_output, routing_request_args
    shape = RoutingShape(num_layers=3, top_k=2, num_experts=8, moe_layers=(1, 2))
    req = Request("a", [5, 6, 7, 8, 9], routed_experts_start=3)
    assert routing_request_args(req, shape) == {"return_routed_experts": True, "routed_experts_start_len": 3}
    assert routing_request_args(req, None) == {}  # the engine records no routing: SGLang is asked for none
    req.routed_experts_start = 6
    with pytest.raises(EngineError, match=r"routed_experts_start 6 is outside \[0, 5\]"):
        routing_request_args(req, shape)
    arr = np.random.default_rng(2).integers(0, 8, (9, 3, 2))  # 5 prompt + 5 output - 1 rows of the full sequence
    arr[:, 0] = 0
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in (1, 2, 3, 4, 10)], "finish_reason": {"type": "stop"}}
    out = {"output_ids": [1, 2, 3, 4, 10], "meta_info": meta}
    for start in (0, 3, 5):  # SGLang's rows: [seqlen - 1 - start, L, k], row i = input token start + i
        r = Request("a", [5, 6, 7, 8, 9], routed_experts_start=start)
        c = completion_from_output(r, {**out, "meta_info": {**meta, "routed_experts": _payload(arr[start:])}}, 0,
                                   routing=shape)
        assert c.routed_experts_start == start and torch.equal(c.routed_experts, torch.from_numpy(arr[start:]).to(
            torch.uint8))
    r = Request("a", [5, 6, 7, 8, 9], routed_experts_start=3)
    with pytest.raises(EngineError, match=r"routed_experts_start_len 3\): routed experts cover 9 tokens, expected 6"):
        completion_from_output(r, {**out, "meta_info": {**meta, "routed_experts": _payload(arr)}}, 0, routing=shape)
    assert completion_from_output(r, out, 0).routed_experts_start == 0  # replay off: no rows, nothing to place


def test_merge_places_rows_at_their_start_and_refuses_gaps():
    full = torch.arange(10 * 2 * 2).view(10, 2, 2).to(torch.uint8)
    kept = full[:4].clone()
    assert torch.equal(merge_resumed(kept, full[4:], 10, start=4), full)
    assert torch.equal(merge_resumed(kept, full[2:], 10, start=2), full)  # overlap: the rows held stay
    assert torch.equal(merge_resumed(kept, torch.zeros(8, 2, 2, dtype=torch.uint8), 10, start=2)[:4], kept)
    with pytest.raises(RoutingError, match=r"from position 5 cannot extend the 4 rows held \(positions 4..4"):
        merge_resumed(kept, full[5:], 10, start=5)
    with pytest.raises(RoutingError, match="from position 3 cannot extend the 0 rows held"):
        merge_resumed(None, full[3:], 10, start=3)
    with pytest.raises(RoutingError, match="covers 9 tokens, the sample has 10"):
        merge_resumed(kept, full[4:9], 10, start=4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_reference_engine_rows_from_start_are_the_full_rows_tail(arch):
    from mtrain.rollout.reference_engine import ReferenceEngine
    engine = ReferenceEngine(dict(tiny_config(arch), num_nextn_predict_layers=0), record_routing=True)
    prompt, params = [3, 9, 4, 17, 5, 8], SamplingParams(max_new_tokens=5, seed=4)
    full = engine.generate([Request("f-", prompt, params)])[0]
    for start in (1, 4, 6):
        part = engine.generate([Request("p-", prompt, params, routed_experts_start=start)])[0]
        assert part.output_ids == full.output_ids and part.routed_experts_start == start
        assert part.routed_experts.shape[0] == len(prompt) + len(part.output_ids) - 1 - start
        assert torch.equal(part.routed_experts, full.routed_experts[start:])
    engine.shutdown()


@pytest.fixture(scope="module")
def tool_engine():
    """A tiny Qwen3-MoE taught to call the calculator, then answer: real two-turn trajectories, routing recorded."""
    from mtrain.rollout.reference_engine import ReferenceEngine, hf_disk_views
    from scripted_model import script_tokens, train_scripted_model
    replies = [{"role": "tool", "name": "calculator", "content": "42"}]
    model = train_scripted_model([script_tokens(TOK, QUESTION, [CALL, "42"], [replies])], config=MOE)
    engine = ReferenceEngine(MOE, record_routing=True)
    engine.update_weights([[(k, v.detach().clone()) for k, v in hf_disk_views(model).items()]])
    engine.finish_weight_update(1)
    yield engine
    engine.shutdown()


def _ctx(**kw):
    from mtrain.rollout.agents.multi_turn import RolloutContext
    from mtrain.tools.calculator import CalculatorTool
    from mtrain.tools.parsers import ToolCallParser
    from mtrain.tools.server import ToolServer
    tools = ToolServer([CalculatorTool()])
    return RolloutContext(tokenizer=TOK, tools=tools, parser=ToolCallParser("qwen25", tools.schemas, backend="mtrain"),
                          params=SamplingParams(max_new_tokens=120, temperature=0.0, stop_token_ids=(TOK.eos_token_id,)),
                          reward_fn=None, system_prompt=None, rid_prefix="g0", max_positions=512, **kw)


def _check_asked_from_held(log, shape):
    """Every request asked from the rows its caller held before it (0 for the first), and got exactly the rest."""
    held = 0
    for req, comp in log:
        assert req.routed_experts_start == held, (req.rid, req.routed_experts_start, held)
        assert comp.routed_experts_start == held
        assert comp.routed_experts.shape == (len(req.prompt_ids) + len(comp.output_ids) - 1 - held, shape.num_layers,
                                             shape.top_k)
        held = len(req.prompt_ids) + len(comp.output_ids) - 1


def test_multi_turn_trajectory_asks_only_for_new_rows(tool_engine):
    import asyncio

    from mtrain.rollout.agents.multi_turn import rollout_group
    from mtrain.rollout.trajectory import to_batch
    shape = routing_shape(MOE)
    sample = PromptSample(0, QUESTION, "42")
    new, old = RecordingClient(tool_engine), FromZero(tool_engine)
    (t,) = asyncio.run(rollout_group(sample, 1, new, _ctx()))
    (ref,) = asyncio.run(rollout_group(sample, 1, old, _ctx()))
    assert t.turns == 2 and t.tool_calls and [s.kind for s in t.segments] == ["prompt", "model", "env", "model"]
    assert t.tokens == ref.tokens and torch.equal(t.routed_experts, ref.routed_experts)  # bit for bit
    assert t.routed_experts.shape[0] == len(t.tokens) - 1
    _check_asked_from_held(new.log, shape)
    assert [r.routed_experts_start for r, _ in old.log] == [0, 0]
    # each row sent once with start_len; start 0 re-sends turn 1's rows with turn 2
    assert t.routing_rows_received == len(t.tokens) - 1
    assert ref.routing_rows_received == len(t.tokens) - 1 + len(old.log[0][0].prompt_ids) + len(
        old.log[0][1].output_ids) - 1
    sent, sent_ref = received_bytes([t], shape), received_bytes([ref], shape)
    assert sent["routing/engine_bytes_per_token"] == shape.sglang_bytes_per_token
    assert sent_ref["routing/engine_bytes_per_sample"] > sent["routing/engine_bytes_per_sample"] == \
        (len(t.tokens) - 1) * shape.sglang_bytes_per_token
    b, b_ref = to_batch([t], pad_id=0, rewards=[0.0], routing=shape), to_batch([ref], pad_id=0, rewards=[0.0],
                                                                              routing=shape)
    assert torch.equal(b.routed_experts, b_ref.routed_experts)


def test_multi_turn_turn_after_a_weight_sync_takes_every_row(tool_engine):
    """A sync between two turns of a trajectory (no abort: the trajectory was between turns, e.g. running a tool):
    the next turn runs on other weights than the held rows were routed under, so it asks for every row and they
    replace the held ones (docs/design-routing-replay.md, "One routing per token"). Here the sync writes no new
    values (it only moves the engine to version 2), so the routing must still equal the start-0 reference's."""
    import asyncio

    from mtrain.rollout.agents.multi_turn import rollout_group

    class SyncAfterFirst(RecordingClient):
        async def generate(self, request):
            comp = await super().generate(request)
            if len(self.log) == 1:
                self.engine.finish_weight_update(2)
            return comp

    sample = PromptSample(0, QUESTION, "42")
    client = SyncAfterFirst(tool_engine)
    try:
        (t,) = asyncio.run(rollout_group(sample, 1, client, _ctx()))
        (ref,) = asyncio.run(rollout_group(sample, 1, FromZero(tool_engine), _ctx()))
    finally:
        tool_engine.finish_weight_update(1)
    assert t.turns == 2 and [comp.weight_version for _, comp in client.log] == [1, 2]
    assert [req.routed_experts_start for req, _ in client.log] == [0, 0]  # the turn after the sync: every row
    assert t.routing_version == 2 and t.tokens == ref.tokens and torch.equal(t.routed_experts, ref.routed_experts)
    assert t.routing_rows_received == len(client.log[0][0].prompt_ids) + len(client.log[0][1].output_ids) - 1 + \
        len(t.tokens) - 1


def _abort_after(engine, fut, tokens: int):
    while not any(n >= tokens for n in engine.active_requests().values()) and not fut.done():
        time.sleep(0.005)
    engine.abort()
    return fut.result()


def test_multi_turn_resume_after_abort_takes_every_row_then_only_new_ones(tool_engine):
    """A trajectory aborted mid-turn, resumed twice from the same state (here with start_len and with start 0 on every
    request): the resumed turn re-feeds the whole trajectory under the new weights, so it asks from 0 and its rows
    replace the held ones; the turns after it ask only for the rows they add."""
    import asyncio

    from mtrain.rollout.agents.multi_turn import new_trajectory, resume_group
    sample = PromptSample(0, QUESTION, "42")
    t = new_trajectory(sample, _ctx(), "g0-0-")
    tool_engine._decode_delay_s = 0.01
    try:
        async def aborted():
            task = asyncio.ensure_future(resume_group([t], LocalClient(tool_engine), _ctx()))
            while not any(n >= 30 for n in tool_engine.active_requests().values()):
                await asyncio.sleep(0.005)
            tool_engine.abort()
            return await task
        (t,) = asyncio.run(aborted())
    finally:
        tool_engine._decode_delay_s = 0.0
    assert t.finish_reason == "abort" and t.routed_experts.shape[0] == len(t.tokens) - 1
    a, b = copy.deepcopy(t), copy.deepcopy(t)
    new, old = RecordingClient(tool_engine), FromZero(tool_engine)
    (a,) = asyncio.run(resume_group([a], new, _ctx()))
    (b,) = asyncio.run(resume_group([b], old, _ctx()))
    assert a.finish_reason == b.finish_reason == "stop" and a.tokens == b.tokens
    assert torch.equal(a.routed_experts, b.routed_experts)
    assert t.routed_experts.shape[0] > 0 and new.log[0][0].routed_experts_start == 0  # the resumed turn: all
    assert len(new.log) > 1  # the calculator's answer comes in a later turn
    held = len(new.log[0][0].prompt_ids) + len(new.log[0][1].output_ids) - 1
    for req, comp in new.log[1:]:
        assert req.routed_experts_start == held == comp.routed_experts_start
        held = len(req.prompt_ids) + len(comp.output_ids) - 1
    got = sum(int(comp.routed_experts.shape[0]) for _, comp in new.log)
    assert got == len(a.tokens) - 1  # the resumed turn's full set, then only new rows: one row per token in all
    assert a.routing_rows_received == t.routing_rows_received + got < b.routing_rows_received


def test_partial_resume_takes_every_row():
    """A single-turn partial-rollout sample aborted mid-way and resumed (next step, new weights): the resumed request
    asks from position 0 and its rows replace the held ones, as a request from 0 by hand gives."""
    from mtrain.rollout import partial
    from mtrain.rollout.reference_engine import ReferenceEngine
    engine = ReferenceEngine(dict(tiny_config("deepseek_v3"), num_nextn_predict_layers=0), record_routing=True,
                             decode_delay_s=0.01)
    group = partial.new_group(0, 0, [5, 6, 7, 8, 9], 1, base_seed=3)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    first = _abort_after(engine, engine.submit(partial.resume_request(group, 0, params, "s0")), 4)
    assert first.finish_reason == "abort" and first.routed_experts_start == 0
    partial.apply(group, 0, first)
    engine._decode_delay_s = 0.0
    req = partial.resume_request(group, 0, params, "s1")
    assert req.routed_experts_start == 0
    second = engine.generate([req])[0]
    partial.apply(group, 0, second)
    (c,) = group.completions()
    assert torch.equal(c.routed_experts, second.routed_experts)
    assert c.routed_experts.shape[0] == len(c.prompt_ids) + len(c.output_ids) - 1
    assert c.routed_rows_received == first.routed_experts.shape[0] + second.routed_experts.shape[0]
    restored = partial.from_state(partial.to_state([group]))[0]  # checkpointed with its count
    assert restored.samples[0].routing_rows_received == c.routed_rows_received
    engine.shutdown()
