"""The OpenAI front with the real `openai` client over real HTTP on 127.0.0.1, against the real CPU reference
engine. Checked against independent references: the HF tokenizer's own chat template rendering (text level), and
the engine called directly with the same prompt ids and seed."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from front_fixtures import MODEL
from mtrain.rollout.protocol import Request, SamplingParams
from mtrain.rollout.trajectory import to_batch


def direct(engine, tokenizer, prompt_ids, seed, max_new, temperature=1.0):
    eos = (tokenizer.eos_token_id,)
    return engine.generate([Request("direct-", list(prompt_ids), SamplingParams(
        max_new_tokens=max_new, temperature=temperature, stop_token_ids=eos, seed=seed))])[0]


def strip_eos(tokenizer, ids):
    return ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids


def new_session(server) -> tuple[str, str]:
    r = httpx.post(f"{server.url}/sessions", headers={"Authorization": f"Bearer {server.api_key}"})
    r.raise_for_status()
    return r.json()["id"], r.json()["base_url"]


def test_models_and_chat_equal_the_engine_called_directly(server, engine, tokenizer):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key)
    assert [m.id for m in c.models.list().data] == [MODEL]
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 56 + 7?"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=12, seed=100, logprobs=True,
                                  temperature=0.9)
    ref_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref_prompt = list(ref_prompt["input_ids"] if hasattr(ref_prompt, "keys") else ref_prompt)
    assert r.usage.prompt_tokens == len(ref_prompt)
    assert len(r.choices) == 3 and len({ch.message.content for ch in r.choices}) > 1  # distinct seeds per choice
    for j, ch in enumerate(r.choices):
        ref = direct(engine, tokenizer, ref_prompt, 100 + j, 12, temperature=0.9)
        assert ch.message.content == tokenizer.decode(strip_eos(tokenizer, ref.output_ids), skip_special_tokens=True)
        assert ch.finish_reason == ref.finish_reason
        lps = [x.logprob for x in ch.logprobs.content]
        assert len(lps) == len(ref.output_ids)
        assert lps == pytest.approx(ref.logprobs, abs=1e-4)  # batching changes the last float32 bits only
        assert [x.token for x in ch.logprobs.content] == [tokenizer.decode([t]) for t in ref.output_ids]
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)


def test_streaming_gives_the_same_text_and_usage(server):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=16, seed=7, n=2)
    full = c.chat.completions.create(**kw)
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [texts[i] for i in (0, 1)] == [ch.message.content for ch in full.choices]
    assert [finish[i] for i in (0, 1)] == [ch.finish_reason for ch in full.choices]
    assert usage.total_tokens == full.usage.total_tokens


def test_completions_with_token_ids_and_stop_strings(server, engine, tokenizer):
    c = OpenAI(base_url=server.base_url, api_key=server.api_key)
    prompt = "The answer is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, seed=3, logprobs=1)
    ids = tokenizer.encode(prompt)
    ref = direct(engine, tokenizer, ids, 3, 20)
    assert r.choices[0].text == tokenizer.decode(strip_eos(tokenizer, ref.output_ids), skip_special_tokens=True)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    # a stop string taken from the middle of that text: the text ends before it, finish "stop"
    text = r.choices[0].text
    assert len(text) > 8
    stop = text[5:7]
    s = c.completions.create(model=MODEL, prompt=ids, max_tokens=20, seed=3, stop=[stop, "never seen"])
    assert s.choices[0].text == text[:text.find(stop)] and s.choices[0].finish_reason == "stop"
    assert s.usage.completion_tokens < r.usage.completion_tokens


def test_session_records_exact_tokens_token_in_token_out(server, engine, tokenizer):
    sid, base = new_session(server)
    c = OpenAI(base_url=base, api_key=server.api_key)
    messages = [{"role": "user", "content": "Hello there."}]
    r1 = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=11)
    messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=12)
    s = server.front.sessions.get(sid)
    assert (s.calls, len(s.branches), len(s.leaves()), s.summary()["rerendered"]) == (2, 2, 1, 0)
    traj = s.leaves()[0].trajectory
    assert [seg.kind for seg in traj.segments] == ["prompt", "model", "env", "model"]
    # turn 2's prompt = turn 1's tokens + the appended messages only; as text it is the template's own rendering
    prompt2 = traj.segments[0].ids + traj.segments[1].ids + traj.segments[2].ids
    # (the model's turn as it generated it: a random model may sample special tokens the returned text leaves out)
    spoken = [{**messages[1], "content": tokenizer.decode(strip_eos(tokenizer, traj.segments[1].ids))}]
    assert tokenizer.decode(prompt2) == tokenizer.apply_chat_template(messages[:1] + spoken + messages[2:],
                                                                      tokenize=False, add_generation_prompt=True)
    assert r2.usage.prompt_tokens == len(prompt2)
    # each model segment is exactly what the engine generates from that prompt with that seed
    for seg, prompt, seed in ((traj.segments[1], traj.segments[0].ids, 11), (traj.segments[3], prompt2, 12)):
        ref = direct(engine, tokenizer, prompt, seed, 10)
        assert seg.ids == ref.output_ids and seg.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert seg.versions == [engine.weight_version] * len(seg.ids)
    # the reward endpoint, then the trainer's batch
    httpx.post(f"{server.url}/sessions/{sid}/reward", json={"reward": 0.5},
               headers={"Authorization": f"Bearer {server.api_key}"}).raise_for_status()
    assert s.reward == 0.5
    from mtrain.serve.sessions import trajectories
    batch = to_batch(trajectories(s), pad_id=tokenizer.pad_token_id)
    n1, n2 = len(traj.segments[1].ids), len(traj.segments[3].ids)
    assert batch.response_mask.sum().item() == n1 + n2 and batch.rewards.tolist() == [0.5]
    p = len(traj.segments[0].ids)
    assert batch.response_mask[0, p - 1:p - 1 + n1].tolist() == [1.0] * n1
    assert batch.versions[0][batch.response_mask[0] > 0].tolist() == traj.segments[1].versions + traj.segments[3].versions


def test_edited_history_starts_a_reported_branch(server):
    sid, base = new_session(server)
    c = OpenAI(base_url=base, api_key=server.api_key)
    m = [{"role": "user", "content": "One."}]
    r1 = c.chat.completions.create(model=MODEL, messages=m, max_tokens=6, seed=1)
    edited = [{"role": "user", "content": "One!"}, r1.choices[0].message.model_dump(exclude_none=True),
              {"role": "user", "content": "Two."}]
    c.chat.completions.create(model=MODEL, messages=edited, max_tokens=6, seed=2)
    summary = httpx.get(f"{server.url}/sessions/{sid}", headers={"Authorization": f"Bearer {server.api_key}"}).json()
    assert (summary["branches"], summary["leaves"], summary["rerendered"]) == (2, 2, 1)
    auth = {"Authorization": f"Bearer {server.api_key}"}
    assert httpx.delete(f"{server.url}/sessions/{sid}", headers=auth).json() == {"id": sid, "deleted": True}
    gone = httpx.get(f"{server.url}/sessions/{sid}", headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


def test_concurrent_sessions_are_isolated(server):
    async def agent(k: int):
        sid, base = await asyncio.to_thread(new_session, server)
        c = AsyncOpenAI(base_url=base, api_key=server.api_key)
        m = [{"role": "user", "content": f"agent {k} speaking"}]
        for turn in range(2):
            r = await c.chat.completions.create(model=MODEL, messages=m, max_tokens=5, seed=k * 10 + turn)
            m += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{k}.{turn}"}]
        await c.close()
        return sid, k

    async def main():
        return await asyncio.gather(*(agent(k) for k in range(8)))

    for sid, k in asyncio.run(main()):
        s = server.front.sessions.get(sid)
        assert (s.calls, len(s.leaves())) == (2, 1)
        conv = s.leaves()[0].trajectory.messages
        assert conv[0]["content"] == f"agent {k} speaking" and conv[2]["content"] == f"{k}.0"
        assert all(f"agent {j} " not in str(conv) for j in range(8) if j != k)


def test_bad_requests_get_one_clear_error_and_the_server_keeps_serving(server):
    key = server.api_key
    c = OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    good = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    cases = [  # (call, expected exception, expected status, a word the message must contain)
        (lambda: c.chat.completions.create(**{**good, "model": "gpt-17"}), openai.NotFoundError, 404, "gpt-17"),
        (lambda: c.chat.completions.create(**good, extra_body={"frobnicate": 1}), openai.BadRequestError, 400,
         "frobnicate"),
        (lambda: c.chat.completions.create(**{**good, "temperature": "hot"}), openai.BadRequestError, 400,
         "temperature"),
        (lambda: c.chat.completions.create(**{**good, "n": 0}), openai.BadRequestError, 400, "n"),
        (lambda: c.chat.completions.create(**{**good, "max_tokens": 100_000}), openai.BadRequestError, 400,
         "context length"),
        (lambda: c.chat.completions.create(**{**good, "messages": [{"role": "user", "content": "y" * 600}]}),
         openai.BadRequestError, 400, "context length"),  # the prompt alone is longer than the context
        (lambda: c.chat.completions.create(**{**good, "messages": [{"role": "wizard", "content": "x"}]}),
         openai.BadRequestError, 400, "role"),
        (lambda: c.chat.completions.create(**good, logprobs=True, top_logprobs=21), openai.BadRequestError, 400,
         "top_logprobs"),
        (lambda: c.chat.completions.create(**good, top_logprobs=3), openai.BadRequestError, 400,
         "top_logprobs needs logprobs=true"),
        (lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=6), openai.BadRequestError,
         400, "logprobs"),
        (lambda: c.chat.completions.create(**good, presence_penalty=1.0), openai.BadRequestError, 400,
         "presence_penalty"),
        (lambda: c.chat.completions.create(**good, tool_choice="required"), openai.BadRequestError, 400, "required"),
        (lambda: c.chat.completions.create(**good, tool_choice="auto"), openai.BadRequestError, 400, "needs tools"),
        (lambda: c.chat.completions.create(**{**good, "messages": [{"role": "user", "content": "x" * 70_000}]}),
         openai.APIStatusError, 413, "larger"),
        (lambda: OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).chat.completions.create(**good),
         openai.AuthenticationError, 401, "API key"),
        (lambda: OpenAI(base_url=f"{server.url}/sessions/nope/v1", api_key=key,
                        max_retries=0).chat.completions.create(**good), openai.NotFoundError, 404, "nope"),
        (lambda: c.completions.create(model=MODEL, prompt=[1, 2, 10_000], max_tokens=2), openai.BadRequestError, 400,
         "prompt"),
    ]
    raw = [(b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "JSON object"), (b"\xff\xfe{", 400, "not valid JSON"),
           (b"[" * 30_000 + b"]" * 30_000, 400, "not valid JSON"),
           (b'{"model": "tiny-llama", "messages": "hi"}', 400, "messages")]
    for _ in range(3):  # a bounded loop of bad requests, then a good one
        for call, exc, status, word in cases:
            with pytest.raises(exc) as e:
                call()
            assert e.value.status_code == status and word.lower() in e.value.message.lower(), e.value.message
        for body, status, word in raw:  # bodies the openai client cannot send: raw HTTP
            r = httpx.post(f"{server.base_url}/chat/completions", content=body,
                           headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            assert r.status_code == status and word in r.json()["error"]["message"], r.text
    assert c.chat.completions.create(**good).choices[0].message.content is not None
    assert server._thread.is_alive()


def test_n_choices_in_a_session_are_branches_and_token_prompts_continue_them(server, engine, tokenizer):
    sid, base = new_session(server)
    c = OpenAI(base_url=base, api_key=server.api_key)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Fork."}], n=3, max_tokens=4,
                                  seed=40)
    s = server.front.sessions.get(sid)
    assert (len(s.branches), len(s.leaves())) == (3, 3)
    assert [tokenizer.decode(strip_eos(tokenizer, b.trajectory.segments[1].ids), skip_special_tokens=True)
            for b in s.branches] == [ch.message.content for ch in r.choices]
    # /v1/completions with a token prompt that extends branch 1's tokens continues that branch
    extra = tokenizer.encode("!", add_special_tokens=False)
    prompt = s.branches[1].trajectory.tokens + extra
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, seed=41)
    b = s.branches[-1]
    assert b.parent == 1 and [x.kind for x in b.trajectory.segments] == ["prompt", "model", "env", "model"]
    assert b.trajectory.segments[2].ids == extra and b.trajectory.tokens[:len(prompt)] == prompt
    assert (len(s.leaves()), s.summary()["rerendered"]) == (3, 0)
    c.completions.create(model=MODEL, prompt="a text prompt", max_tokens=3, seed=42)
    assert s.branches[-1].parent is None and s.summary()["rerendered"] == 1  # text prompts start a root branch


def test_concurrency_limit_gives_429_while_the_engine_holds_requests(engine, tokenizer):
    import threading

    from mtrain.rollout.client import LocalClient
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer
    front = OpenAIFront(LocalClient(engine), tokenizer, model_name=MODEL, max_positions=512)
    with FrontServer(front, max_concurrency=1) as srv:
        c = OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "wait"}], max_tokens=2)
        engine.pause()
        try:
            held = {}
            t = threading.Thread(target=lambda: held.setdefault("r", c.chat.completions.create(**kw)))
            t.start()
            time.sleep(1.0)  # no other request meanwhile: the held call must take the only slot, not race for it
            assert t.is_alive()
            with pytest.raises(openai.RateLimitError) as e:
                c.models.list()
            assert e.value.status_code == 429 and "already running" in e.value.message
        finally:
            engine.resume()
        t.join(timeout=30)
        assert held["r"].choices[0].finish_reason in ("stop", "length")
        assert c.chat.completions.create(**kw).choices  # the slot is free again
