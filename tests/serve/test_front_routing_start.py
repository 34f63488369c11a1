"""Routing replay through the OpenAI front's agent sessions: a call that continues a recorded branch asks the engine
only for the rows the branch lacks (`routed_experts_start`), and the session's trajectories end with exactly the
routing today's start-0 calls give (a front whose client forces start 0 is the reference), bit for bit. Real HTTP,
the real `openai` client, the CPU reference engine (tiny Qwen3-MoE) recording its own router."""
from __future__ import annotations

import dataclasses

import httpx
import torch
from openai import OpenAI

from front_fixtures import MODEL, chatml_tokenizer
from mtrain.rollout import ReferenceEngine
from mtrain.rollout.client import RecordingClient
from mtrain.rollout.routing import received_bytes, routing_shape
from mtrain.serve import sessions as S
from mtrain.serve.front import OpenAIFront
from mtrain.serve.server import FrontServer
from mtrain.tiny_configs import tiny_config


class Recording(RecordingClient):
    def __init__(self, engine, from_zero: bool):
        super().__init__(engine)
        self.from_zero = from_zero

    async def generate(self, request):
        if self.from_zero:  # today's behaviour: every call asks for all of its rows
            request = dataclasses.replace(request, routed_experts_start=0)
        return await super().generate(request)


def _session(client, tokenizer):
    """Three calls of one agent: a first turn, a continuation, and a continuation with n=2 (two branches)."""
    front = OpenAIFront(client, tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=8)
    srv = FrontServer(front, max_body_bytes=64 << 10, max_concurrency=8)
    srv.start()
    try:
        r = httpx.post(f"{srv.url}/sessions", headers={"Authorization": f"Bearer {srv.api_key}"})
        sid, base = r.json()["id"], r.json()["base_url"]
        c = OpenAI(base_url=base, api_key=srv.api_key)
        messages = [{"role": "user", "content": "Hello there."}]
        for call, n in enumerate((1, 1, 2)):
            out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=20 + call, n=n)
            messages += [out.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"And then {call}?"}]
        return S.trajectories(front.sessions.take(sid), reward=0.0)
    finally:
        srv.stop()


def test_session_calls_ask_only_for_the_rows_their_branch_lacks():
    tokenizer = chatml_tokenizer()
    cfg = dict(tiny_config("qwen3_moe"), vocab_size=len(tokenizer), max_position_embeddings=512)
    engine = ReferenceEngine(cfg, record_routing=True)
    shape = routing_shape(cfg)
    try:
        new, old = Recording(engine, from_zero=False), Recording(engine, from_zero=True)
        got, ref = _session(new, tokenizer), _session(old, tokenizer)
    finally:
        engine.shutdown()
    assert len(got) == len(ref) == 2  # the last call's two choices are the session's leaves
    for t, r in zip(got, ref):
        assert t.tokens == r.tokens and [s.kind for s in t.segments] == ["prompt", "model", "env", "model", "env",
                                                                        "model"]
        assert t.routed_experts.shape[0] == len(t.tokens) - 1
        assert torch.equal(t.routed_experts, r.routed_experts)  # bit for bit
    starts = [req.routed_experts_start for req, _ in new.log]
    # call 1 holds nothing; call 2 asks from its branch's rows; call 3's two choices from the same, longer branch
    assert starts[0] == 0 and 0 < starts[1] < starts[2] == starts[3]
    assert starts[1] == len(new.log[0][0].prompt_ids) + len(got[0].segments[1].ids) - 1
    for req, comp in new.log:
        assert comp.routed_experts_start == req.routed_experts_start
        assert comp.routed_experts.shape[0] == len(req.prompt_ids) + len(comp.output_ids) - 1 - req.routed_experts_start
    assert all(req.routed_experts_start == 0 for req, _ in old.log)
    sent, sent_ref = received_bytes(got, shape), received_bytes(ref, shape)
    assert sent["routing/engine_bytes_per_sample"] < sent_ref["routing/engine_bytes_per_sample"]
    # each leaf received its own rows once (the shared first two calls count for both leaves)
    assert all(t.routing_rows_received == len(t.tokens) - 1 for t in got)
