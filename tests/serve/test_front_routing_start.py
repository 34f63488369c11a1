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


def _session(client, tokenizer, between=None):
    """Three calls of one agent: a first turn, a continuation, and a continuation with n=2 (two branches).
    between(call): run after each call (a weight sync)."""
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
            if between is not None:
                between(call)
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


def _random_weights(cfg, seed):
    from transformers import AutoModelForCausalLM

    from mtrain.rollout.reference_engine import as_hf_config, hf_disk_views
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(as_hf_config(cfg))
    return [[(k, v.detach().clone()) for k, v in hf_disk_views(model).items()]]


def test_a_session_continued_across_a_weight_sync_takes_every_row_then_only_new_ones():
    """An agent's session spans a weight sync (server-based RL: the agent keeps calling while the trainer steps). The
    call after the sync is fed the whole branch under the new weights and samples from that forward, so it asks for
    every row and they replace the branch's rows of the old weights; the next call (same weights) asks only for the
    new rows again. The leaves end with exactly the routing of a client that asks every call from 0, bit for bit,
    and not with the first call's rows."""
    tokenizer = chatml_tokenizer()
    cfg = dict(tiny_config("qwen3_moe"), vocab_size=len(tokenizer), max_position_embeddings=512)
    engine = ReferenceEngine(cfg, record_routing=True)
    w1, w2 = _random_weights(cfg, 1), _random_weights(cfg, 2)

    def run(client):
        engine.update_weights(w1)
        engine.finish_weight_update(1)

        def sync(call):
            if call == 0:
                engine.update_weights(w2)
                engine.finish_weight_update(2)
        return _session(client, tokenizer, between=sync)

    try:
        new, old = Recording(engine, from_zero=False), Recording(engine, from_zero=True)
        got, ref = run(new), run(old)
    finally:
        engine.shutdown()
    starts = [req.routed_experts_start for req, _ in new.log]
    versions = [comp.weight_version for _, comp in new.log]
    assert versions == [1, 2, 2, 2]
    assert starts[0] == starts[1] == 0 and 0 < starts[2] == starts[3]  # the call after the sync asks for every row
    first_req, first = new.log[0]
    stale = first.routed_experts  # the first call's rows, routed under the old weights
    for t, r in zip(got, ref):
        assert t.tokens == r.tokens and t.routing_version == 2
        assert torch.equal(t.routed_experts, r.routed_experts)  # bit for bit
    assert not torch.equal(got[0].routed_experts[:stale.shape[0]], stale)  # the old weights' rows are gone


def test_trajectory_routing_follows_the_weights_it_was_recorded_under():
    """Trajectory.record_routing / routing_request_start without an engine: rows extend only on the same weights; a
    request from 0 replaces them; a request that asked from later but ran on other weights (a sync between building
    it and running it) leaves rows of two versions, and the next request then re-asks every row."""
    from mtrain.rollout.trajectory import Segment, Trajectory

    traj = Trajectory("t", [Segment("prompt", [1, 2, 3, 4])])
    rows = lambda n, fill: torch.full((n, 2, 2), fill, dtype=torch.uint8)  # noqa: E731
    traj.add_model_tokens([5, 6], [0.0, 0.0], 1)
    traj.record_routing(rows(5, 1), 0, 1)
    assert traj.routing_request_start(1) == 5 and traj.routing_request_start(2) == 0
    traj.add_model_tokens([7], [0.0], 1)
    traj.record_routing(rows(1, 1), 5, 1)  # the same weights: extends
    assert traj.routed_experts.shape[0] == 6 and traj.routing_version == 1
    traj.add_model_tokens([8], [0.0], 2)
    traj.record_routing(rows(7, 2), 0, 2)  # on new weights from 0: replaces
    assert torch.equal(traj.routed_experts, rows(7, 2)) and traj.routing_request_start(2) == 7
    traj.add_model_tokens([9], [0.0], 3)
    traj.record_routing(rows(1, 3), 7, 3)  # asked from 7 on version 2's rows, ran on version 3: mixed
    assert traj.routing_version is None and traj.routing_request_start(3) == 0
