"""A weight sync in the middle of a session: the pool pauses, the front holds (does not fail) the agent's next
call, new weights land, the call runs on them; the recorded trajectory keeps each token's version."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from front_fixtures import MODEL, tiny_config
from mtrain.rollout.protocol import Request, SamplingParams
from mtrain.rollout.reference_engine import as_hf_config, hf_disk_views


def finish_of(c, stream: bool, **kw) -> str:
    """The first choice's finish_reason of a call, streamed (the front holds a stream's start the same way) or not."""
    if not stream:
        return c.chat.completions.create(**kw).choices[0].finish_reason
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
    return finish


@pytest.mark.parametrize("stream", [False, True])
def test_sync_between_turns_holds_the_call_and_keeps_versions(server, engine, tokenizer, stream):
    sid = server.front.sessions.create().id
    c = OpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key=server.api_key, max_retries=0)
    m = [{"role": "user", "content": "Turn one."}]
    r1 = c.chat.completions.create(model=MODEL, messages=m, max_tokens=8, seed=5)
    m += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Turn two."}]
    v0 = engine.weight_version

    engine.pause()  # what the pool does before a sync
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", finish_of(c, stream, model=MODEL, messages=m,
                                                                      max_tokens=8, seed=6)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and "r" not in out  # held, not failed
    torch.manual_seed(123)
    new = AutoModelForCausalLM.from_config(as_hf_config(tiny_config(len(tokenizer))), dtype=torch.float32)
    specs = engine.parameter_specs()
    engine.update_weights([[(k, v.detach().clone()) for k, v in hf_disk_views(new).items() if k in specs]])
    engine.finish_weight_update(v0 + 1)
    engine.resume()
    t.join(timeout=60)
    assert "r" in out and out["r"] in ("stop", "length")

    traj = server.front.sessions.get(sid).leaves()[0].trajectory
    model_segs = [s for s in traj.segments if s.kind == "model"]
    assert [set(s.versions) for s in model_segs] == [{v0}, {v0 + 1}]
    prompt2 = [t for s in traj.segments[:3] for t in s.ids]
    ref = engine.generate([Request("ref-", prompt2, SamplingParams(max_new_tokens=8, seed=6,
                                                                   stop_token_ids=(tokenizer.eos_token_id,)))])[0]
    assert model_segs[1].ids == ref.output_ids  # turn two ran on the new weights


@pytest.mark.parametrize("stream", [False, True])
def test_a_pool_abort_by_prefix_reaches_a_sessions_held_call(server, engine, stream):
    """Sessions made by agent_group_fn carry the pool call's rid prefix: aborting it ends the agent's call."""
    s = server.front.sessions.create(rid_prefix="step7-3-1-")
    c = OpenAI(base_url=f"{server.url}/sessions/{s.id}/v1", api_key=server.api_key, max_retries=0)
    engine.pause()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", finish_of(
        c, stream, model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8)))
    try:
        t.start()
        time.sleep(0.5)
        assert t.is_alive()
        engine.abort("step7-")  # what RolloutPool.run does to its own requests on failure or quota
        t.join(timeout=30)
    finally:
        engine.resume()
    assert out["r"] == "abort"
    assert s.branches[-1].trajectory.finish_reason == "abort"


def test_a_client_that_goes_away_mid_call_leaves_the_engine_serving(server, engine):
    """A client that disconnects while its call is held: the call is aborted in the engine (not left to run, not
    cancelled under the engine's feet), and the next calls are served."""
    import httpx
    engine.pause()
    try:
        with __import__("pytest").raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/chat/completions", timeout=0.5,
                       headers={"Authorization": f"Bearer {server.api_key}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "bye"}], "max_tokens": 4})
        time.sleep(0.5)
    finally:
        engine.resume()
    c = OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=30)
    for _ in range(3):
        assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=3).choices[0].finish_reason in ("stop", "length")


def test_a_cancelled_call_is_aborted_and_the_engine_keeps_serving(server, engine):
    """Cancelling a call's handler (what a server stop does) aborts its engine request; the engine thread lives."""
    import asyncio

    from mtrain.serve.schemas import ChatRequest
    front = server.front
    req = ChatRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "c"}], "max_tokens": 3})

    async def main():
        engine.pause()
        try:
            t = asyncio.ensure_future(front.chat(req, None))
            await asyncio.sleep(0.3)
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(0.2)
        finally:
            engine.resume()
        return await asyncio.wait_for(front.chat(req, None), timeout=30)

    res = asyncio.run(main())
    assert res.choices[0].finish_reason in ("stop", "length")
