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
from mtrain.rollout.agents.openai_agent import session_trajectory


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
