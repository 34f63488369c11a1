"""Hostile input to the OpenAI front over real HTTP on 127.0.0.1 (real reference engine, real `openai` client):
non-finite and repeated rewards, numbers given as strings, bodies that are not declared JSON. Each is refused with
an OpenAI-shaped 4xx before anything is stored, and the next request is served."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from front_fixtures import MODEL
from mtrain.data.rewards import RewardError
from mtrain.serve.openai_agent import session_trajectory


def _auth(server):
    return {"Authorization": f"Bearer {server.api_key}"}


def _new_session(server) -> str:
    r = httpx.post(f"{server.url}/sessions", headers=_auth(server))
    r.raise_for_status()
    return r.json()["id"]


@pytest.mark.parametrize("raw", ['{"reward": NaN}', '{"reward": Infinity}', '{"reward": -Infinity}',
                                 '{"reward": 1e999}', '{"reward": ' + str(10 ** 400) + '}'])
def test_non_finite_reward_is_a_400_and_nothing_is_stored(server, raw):
    sid = _new_session(server)
    headers = dict(_auth(server), **{"Content-Type": "application/json"})
    r = httpx.post(f"{server.url}/sessions/{sid}/reward", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    got = httpx.get(f"{server.url}/sessions/{sid}", headers=_auth(server))
    assert got.status_code == 200 and got.json()["reward"] is None  # nothing kept: the summary still serializes
    r = httpx.post(f"{server.url}/sessions/{sid}/reward", json={"reward": 0.5}, headers=_auth(server))
    assert r.status_code == 200 and r.json()["reward"] == 0.5


def test_a_second_reward_is_refused_and_the_first_counts(server):
    sid = _new_session(server)
    assert httpx.post(f"{server.url}/sessions/{sid}/reward", json={"reward": 1},
                      headers=_auth(server)).status_code == 200
    r = httpx.post(f"{server.url}/sessions/{sid}/reward", json={"reward": 0.0}, headers=_auth(server))
    assert r.status_code == 409 and r.json()["error"]["code"] == "reward_already_set"
    assert httpx.get(f"{server.url}/sessions/{sid}", headers=_auth(server)).json()["reward"] == 1.0


def test_an_agents_non_finite_returned_reward_names_the_session(server):
    c = OpenAI(base_url=f"{server.url}/sessions/{_new_session(server)}/v1", api_key=server.api_key)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    sid = c.base_url.path.split("/")[2]
    with pytest.raises(RewardError, match=f"session {sid}: the agent returned nan; expected a finite number"):
        session_trajectory(server.front.sessions, sid, float("nan"))


@pytest.mark.parametrize("field,value", [("temperature", "1.0"), ("top_p", "0.5"), ("n", "2"), ("max_tokens", "3"),
                                         ("temperature", True), ("frequency_penalty", "0"), ("seed", "1")])
def test_numbers_given_as_strings_are_refused_alike(server, field, value):
    """One rule for every numeric field, as OpenAI's API has it: a JSON number, never a string (or a boolean)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=_auth(server))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    body[field] = {"temperature": 1.0, "top_p": 0.5, "n": 2, "max_tokens": 3, "frequency_penalty": 0,
                   "seed": 1}[field]
    assert httpx.post(f"{server.base_url}/chat/completions", json=body, headers=_auth(server)).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8",
                                   "multipart/form-data; boundary=x"])
def test_bodies_not_declared_json_are_415(server, ctype):
    import json
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(f"{server.base_url}/chat/completions", content=body,
                   headers=dict(_auth(server), **{"Content-Type": ctype}))
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    for ok in ("application/json", "application/json; charset=utf-8"):
        r = httpx.post(f"{server.base_url}/chat/completions", content=body,
                       headers=dict(_auth(server), **{"Content-Type": ok}))
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def short_server(engine, tokenizer):
    """A second front on the same engine, with short read and session timeouts."""
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer
    from mtrain.serve.sessions import SessionStore
    front = OpenAIFront(__import__("mtrain.rollout.client", fromlist=["LocalClient"]).LocalClient(engine), tokenizer,
                        model_name=MODEL, max_positions=512, default_max_tokens=8)
    front.sessions = SessionStore(max_sessions=3, ttl_s=2.0)
    srv = FrontServer(front, read_timeout_s=0.5)
    srv.start()
    yield srv
    srv.stop()


def _closed_within(sock, seconds: float) -> bool:
    import time
    sock.settimeout(seconds)
    t = time.monotonic()
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return time.monotonic() - t < seconds
    except (TimeoutError, OSError):
        return False


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"GET /v1/mod"])
def test_half_open_connections_are_closed(short_server, sent):
    import socket
    host, port = short_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(sent)
        assert _closed_within(s, 3.0), "the server kept a connection that never completed a request"
    c = OpenAI(base_url=short_server.base_url, api_key=short_server.api_key, max_retries=0)
    assert [m.id for m in c.models.list().data] == [MODEL]  # and it still serves


def test_a_body_that_never_arrives_is_a_408(short_server):
    import socket
    host, port = short_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {short_server.api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\"".encode())
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 408")


def test_sessions_expire_and_are_counted(short_server):
    import time
    h = _auth(short_server)
    sids = [httpx.post(f"{short_server.url}/sessions", headers=h).json()["id"] for _ in range(3)]
    r = httpx.post(f"{short_server.url}/sessions", headers=h)
    assert r.status_code == 429  # the count bound
    assert httpx.get(f"{short_server.url}/sessions/{sids[0]}", headers=h).status_code == 200
    time.sleep(2.3)
    assert httpx.get(f"{short_server.url}/sessions/{sids[0]}", headers=h).status_code == 404  # the age bound
    assert httpx.post(f"{short_server.url}/sessions", headers=h).status_code == 200  # room again
    m = httpx.get(f"{short_server.url}/metrics", headers=h).json()
    assert m["sessions_expired"] == 3 and m["sessions_open"] == 1 and m["sessions_ttl_s"] == 2.0


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 10 ** 30}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 63 - 1, "n": 2}),
    ("completions", {"prompt": "hi", "seed": 2 ** 64}),
])
def test_a_seed_beyond_int64_is_a_400_not_an_engine_failure(server, route, body):
    r = httpx.post(f"{server.base_url}/{route}", json={"model": MODEL, "max_tokens": 2, **body}, headers=_auth(server))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    body["seed"] = 2 ** 63 - 65  # the largest seed whose choices' seeds (seed + j) stay int64
    assert httpx.post(f"{server.base_url}/{route}", json={"model": MODEL, "max_tokens": 2, **body},
                      headers=_auth(server)).status_code == 200


@pytest.mark.parametrize("end", ["delete", "take"])
def test_a_reward_arriving_after_its_session_ended_is_a_404(server, end):
    """The reward's body is still arriving when the session is deleted (DELETE) or taken (the trainer collects
    it): the reward is answered 404, never 200 for a value nobody will read."""
    import threading
    import time
    sid = _new_session(server)
    started, answer = threading.Event(), {}

    def body():
        yield b'{"reward": '
        started.set()
        time.sleep(0.5)
        yield b"1.0}"

    def post():
        answer["r"] = httpx.post(f"{server.url}/sessions/{sid}/reward", content=body(), timeout=10,
                                 headers=dict(_auth(server), **{"Content-Type": "application/json"}))
    t = threading.Thread(target=post)
    t.start()
    assert started.wait(5)
    time.sleep(0.1)
    if end == "delete":
        assert httpx.delete(f"{server.url}/sessions/{sid}", headers=_auth(server)).status_code == 200
    else:
        taken = server.front.sessions.take(sid)
    t.join(10)
    r = answer["r"]
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    if end == "take":
        assert taken.reward is None


def test_a_session_past_its_recorded_token_cap_is_refused_openai_shaped(engine, tokenizer):
    """serve.max_session_tokens: a session that has recorded its cap gets 409 session_full (through the real
    `openai` client), counted in /metrics; other sessions are served."""
    from mtrain.rollout.client import LocalClient
    from mtrain.serve.front import OpenAIFront
    from mtrain.serve.server import FrontServer
    from mtrain.serve.sessions import SessionStore
    front = OpenAIFront(LocalClient(engine), tokenizer, model_name=MODEL, max_positions=512, default_max_tokens=8)
    front.sessions = SessionStore(max_session_tokens=150)
    with FrontServer(front) as srv:
        sid = front.sessions.create().id
        c = OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key=srv.api_key, max_retries=0)
        served = 0
        with pytest.raises(openai.APIStatusError) as e:
            for _ in range(50):
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=8, n=2)
                served += 1
        assert e.value.status_code == 409 and e.value.body["code"] == "session_full", e.value.body
        s = front.sessions.get(sid)
        last_call = sum(len(b.trajectory.tokens) for b in s.branches[-2:])  # n=2: the call that crossed the cap
        assert s.recorded_tokens - last_call < 150 <= s.recorded_tokens and served >= 1
        assert s.recorded_tokens == sum(len(b.trajectory.tokens) for b in s.branches)
        m = httpx.get(f"{srv.url}/metrics", headers=_auth(srv)).json()
        assert (m["sessions_refused_full"], m["session_max_tokens"]) == (1, 150)
        other = OpenAI(base_url=f"{srv.url}/sessions/{front.sessions.create().id}/v1", api_key=srv.api_key)
        assert other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2).choices


def test_max_session_tokens_below_one_is_one_config_line():
    from mtrain.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="serve.max_session_tokens"):
        load_config(None, ["model.hf_path=x", "data.task=arithmetic", "serve.max_session_tokens=0"])


@pytest.mark.parametrize("cut", ["length", "chunked"])
def test_a_client_gone_mid_body_logs_no_traceback(server, caplog, cut):
    """A client that closes its connection before its body is complete (a Content-Length it never sends, an
    unterminated chunked body) is an ordinary event: no "unexpected error" traceback, and the next call is served."""
    import logging
    import socket
    import time
    host, port = server.url.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\n")
    head += "Content-Length: 100\r\n\r\n" if cut == "length" else "Transfer-Encoding: chunked\r\n\r\n8\r\n"
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(head.encode() + b'{"model"')
                time.sleep(0.2)
        time.sleep(1.0)
        c = OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
    bad = [x for x in caplog.records if x.levelno >= logging.ERROR or x.exc_info]
    assert not bad, [x.getMessage() for x in bad]


def test_a_bad_query_parameter_is_one_openai_shaped_line(server):
    sid = _new_session(server)
    r = httpx.get(f"{server.url}/sessions/{sid}?tokens=abc", headers=_auth(server))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "tokens (query): Input should be a valid integer, unable to parse string as an integer"
    assert err["param"] == "tokens"
    assert httpx.get(f"{server.url}/sessions/{sid}?tokens=1", headers=_auth(server)).status_code == 200
