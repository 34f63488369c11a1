"""Incremental streaming through the front, with the real `openai` client over real HTTP against the real CPU
reference engine: text arrives while the engine is still generating (proved by a gate that holds the engine inside
its streaming hook until the test has seen the first chunk), adds up to the non-streamed answer (text, logprobs,
finish reasons) for the same seed, never shows a stop string, records the same session trajectory, and a client that
leaves mid-stream gets its request aborted while the server goes on serving."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from openai import OpenAI

from front_fixtures import MODEL
from mtrain.rollout.client import LocalClient, RecordingClient
from mtrain.serve.front import OpenAIFront
from mtrain.serve.server import FrontServer

USER = [{"role": "user", "content": "Tell me a story."}]


class GatedClient(LocalClient):
    """LocalClient whose streamed requests hold the engine inside their hook after every token until `release` is
    set: while it is clear the engine provably cannot finish (or even continue) any of them. Records the
    completions the engine returned and the aborts the front sent."""

    def __init__(self, engine):
        super().__init__(engine)
        self.release = threading.Event()
        self.done, self.aborts = [], []

    async def generate(self, request):
        inner = request.on_tokens
        if inner is not None:
            def gated(delta):
                inner(delta)
                self.release.wait(timeout=60)
            request = dataclasses.replace(request, on_tokens=gated)
        c = await super().generate(request)
        self.done.append(c)
        return c

    def abort(self, rid_prefix=None):
        self.aborts.append(rid_prefix)
        super().abort(rid_prefix)


@pytest.fixture(scope="module")
def gated(engine, tokenizer):
    client = GatedClient(engine)
    front = OpenAIFront(client, tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=24)
    with FrontServer(front) as srv:
        yield srv, client


def _collect(stream) -> tuple[dict, dict, dict]:
    texts, lps, finish = {}, {}, {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.logprobs is not None and ch.logprobs.content:
                lps.setdefault(ch.index, []).extend(ch.logprobs.content)
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return texts, lps, finish


def test_streamed_text_and_logprobs_equal_the_non_streamed_call(server):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=24, seed=5, n=3, logprobs=True, top_logprobs=2)
    full = c.chat.completions.create(**kw)
    texts, lps, finish = _collect(c.chat.completions.create(**kw, stream=True))
    for ch in full.choices:
        assert texts[ch.index] == ch.message.content and finish[ch.index] == ch.finish_reason
        want = ch.logprobs.content
        assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in lps[ch.index]] == [
            (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in want]
        # logprobs to float32 rounding: the engine's batch may be composed differently between the two calls
        assert [e.logprob for e in lps[ch.index]] == pytest.approx([e.logprob for e in want], abs=1e-5)
    # the legacy completions API streams the same way
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, seed=9, n=2, logprobs=2)
    full = c.completions.create(**kw)
    got, toks = {}, {}
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                toks.setdefault(ch.index, []).extend(ch.logprobs.tokens)
    assert [got[i] for i in range(2)] == [ch.text for ch in full.choices]
    assert [toks[i] for i in range(2)] == [ch.logprobs.tokens for ch in full.choices]


def test_stop_strings_never_reach_the_stream(server):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=40, temperature=1.0)
    checked = 0
    for seed in range(12):
        text = c.chat.completions.create(**kw, seed=seed).choices[0].message.content
        if len(text) < 12:
            continue
        stops = [text[6:8], text[9:12]]  # two and three characters from inside the answer (several tokens each)
        want = c.chat.completions.create(**kw, seed=seed, stop=stops).choices[0]
        texts, _, finish = _collect(c.chat.completions.create(**kw, seed=seed, stop=stops, stream=True))
        assert texts[0] == want.message.content == text[:min(text.find(s) for s in stops)]
        assert finish[0] == want.finish_reason == "stop"
        assert not any(s in texts[0] for s in stops)
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_first_chunk_arrives_while_the_engine_is_still_generating(gated, engine):
    srv, client = gated
    c = OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0, timeout=60)
    client.release.clear()
    first_at_tokens, done_at_first = None, None
    try:
        stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, seed=3, stream=True)
        text = ""
        for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece and first_at_tokens is None:
                # the engine is held inside its hook: the request is in flight, with the tokens made so far
                first_at_tokens = dict(engine.active_requests())
                done_at_first = len(client.done)
                client.release.set()
            text += piece or ""
    finally:
        client.release.set()
    assert done_at_first == 0 and len(first_at_tokens) == 1
    made = next(iter(first_at_tokens.values()))
    final = client.done[-1]
    assert 1 <= made < len(final.output_ids), (made, len(final.output_ids))
    full = OpenAI(base_url=srv.base_url, api_key=srv.api_key).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=300, seed=3)
    assert text == full.choices[0].message.content


def test_a_client_leaving_mid_stream_aborts_its_request_and_the_server_goes_on(gated, engine):
    srv, client = gated
    c = OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0, timeout=60)
    client.release.clear()
    n_done = len(client.done)
    try:
        stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=400, seed=3, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()  # the connection goes away while the engine is held mid-request
        for _ in range(200):
            if client.aborts:
                break
            time.sleep(0.05)
    finally:
        client.release.set()
    assert client.aborts and client.aborts[-1].startswith("front-")
    for _ in range(200):
        if len(client.done) > n_done:
            break
        time.sleep(0.05)
    left = client.done[n_done]
    assert left.finish_reason == "abort" and len(left.output_ids) < 400
    assert engine.active_requests() == {}
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length")
    texts, _, finish = _collect(c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, seed=1,
                                                          stream=True))
    assert texts[0] == r.choices[0].message.content and finish[0] == r.choices[0].finish_reason


def test_the_recorded_trajectory_is_the_same_with_and_without_streaming(server):
    import httpx

    def session():
        r = httpx.post(f"{server.url}/sessions", headers={"Authorization": f"Bearer {server.api_key}"})
        return r.json()["id"], OpenAI(base_url=r.json()["base_url"], api_key=server.api_key, max_retries=0)

    records = []
    for streamed in (False, True):
        sid, c = session()
        messages = list(USER)
        for turn, seed in enumerate((21, 22)):
            kw = dict(model=MODEL, messages=messages, max_tokens=12, seed=seed, stop=["zz"])
            if streamed:
                texts, _, _ = _collect(c.chat.completions.create(**kw, stream=True))
                reply = texts[0]
            else:
                reply = c.chat.completions.create(**kw).choices[0].message.content
            messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
        records.append(server.front.sessions.take(sid))
    a, b = records
    assert (a.calls, len(a.branches), a.summary()["rerendered"]) == (b.calls, len(b.branches), 0)
    ta, tb = a.leaves()[0].trajectory, b.leaves()[0].trajectory
    assert [(s.kind, s.ids, s.versions) for s in ta.segments] == [(s.kind, s.ids, s.versions) for s in tb.segments]
    for sa, sb in zip(ta.segments, tb.segments):
        assert (sa.logprobs is None) == (sb.logprobs is None)
        if sa.logprobs is not None:
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-5)
    assert ta.finish_reason == tb.finish_reason


def test_a_stream_keeps_its_concurrency_slot_until_its_engine_work_ends(engine, tokenizer):
    import openai

    client = GatedClient(engine)
    front = OpenAIFront(client, tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=24)
    with FrontServer(front, max_concurrency=1) as srv:
        c = OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0, timeout=60)
        try:
            stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=50, seed=3, stream=True)
            next(iter(stream))  # the response has started; the engine is held mid-request
            with pytest.raises(openai.RateLimitError):
                c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        finally:
            client.release.set()
        for _ in stream:
            pass
        for _ in range(100):  # the slot is given back when the call's task ends, just after the last chunk
            try:
                r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
                break
            except openai.RateLimitError:
                time.sleep(0.05)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_a_completed_stop_string_ends_the_engine_request_early(engine, tokenizer):
    # The engine stops on token ids only; a stop string is the front's. Once a choice's text completes one, the front
    # aborts its engine request instead of letting it run to max_tokens (streamed or not), and the answer is the same.
    client = RecordingClient(engine)
    front = OpenAIFront(client, tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=24)
    with FrontServer(front) as srv:
        c = OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
        kw = dict(model=MODEL, messages=USER, max_tokens=160, seed=11)
        full = c.chat.completions.create(**kw)
        text, n_full = full.choices[0].message.content, len(client.log[-1][1].output_ids)
        assert n_full >= 60, "the baseline answer must be long enough for an early stop to show"
        stop = text[4:7]
        for streamed in (False, True):
            if streamed:
                got, _, finish = _collect(c.chat.completions.create(**kw, stop=[stop], stream=True))
                got, finish = got[0], finish[0]
            else:
                r = c.chat.completions.create(**kw, stop=[stop]).choices[0]
                got, finish = r.message.content, r.finish_reason
            assert got == text[:text.find(stop)] and finish == "stop"
            engine_side = client.log[-1][1]
            assert engine_side.finish_reason == "abort" and len(engine_side.output_ids) < n_full // 2, (
                streamed, engine_side.finish_reason, len(engine_side.output_ids))
