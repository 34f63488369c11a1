"""Agents written against the OpenAI API as rollout functions: the pool runs them, the front records them.

An agent is ordinary async Python: `async def agent(base_url, api_key, sample) -> float | None` that talks to
`base_url` with the official `openai` client (`AsyncOpenAI(base_url=base_url, api_key=api_key)`) as it would to
any OpenAI-compatible server, and returns its reward (or None when it posted one to the session's reward
endpoint). `agent_group_fn` turns it into the pool's group function: on the engine leader that claims group i,
n sessions are opened on that leader's front, the agent runs n times concurrently (one session each), and the
sessions' recorded trajectories (exact engine tokens, logprobs, per-token versions; `mtrain.serve.sessions`)
come back with their rewards. The trainer builds its batch from them with `trajectory.to_batch`.

Every run of the agent gives one trajectory: its session's last recorded branch (the conversation the agent
ended on). Other leaves (an edited history, n > 1 calls) are counted in the metrics, not trained on, so a GRPO
group always has n samples.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from mtrain.data.rewards import finite_reward
from mtrain.rollout.client import EngineClient
from mtrain.rollout.protocol import EngineError
from mtrain.rollout.trajectory import Trajectory
from mtrain.serve.server import FrontServer
from mtrain.serve.sessions import SessionStore

Agent = Callable[[str, str, Any], Awaitable[float | None]]


def session_trajectory(store: SessionStore, sid: str, reward: float | None) -> Trajectory:
    """Close session `sid` and return its last branch as a trajectory carrying the reward."""
    s = store.take(sid)
    if reward is not None:
        s.reward = finite_reward(reward, f"session {sid}: the agent")
    if s.reward is None:
        raise EngineError(f"session {sid}: the agent returned no reward and posted none")
    if not s.branches:
        raise EngineError(f"session {sid}: the agent made no call through the front")
    last = s.branches[-1]
    t = last.trajectory
    t.reward = s.reward
    t.metrics = {"session/calls": float(s.calls), "session/branches": float(len(s.branches)),
                 "session/leaves": float(len(s.leaves())), "session/rerendered": float(sum(b.rerendered for b in s.branches)),
                 "session/tokens": float(len(t.tokens))}
    return t


def agent_group_fn(server_of: Callable[[EngineClient], FrontServer], agent: Agent, samples: Sequence[Any], n: int,
                   *, rid_prefix: str = "agents"):
    """The pool's group function for `agent`: group i runs the agent n times on samples[i].

    server_of(client) -> the front this leader serves with `client` (one front per engine leader, started once;
    `FrontRegistry` below keeps them). rid_prefix: pass the pool call's own (`pool.run(..., rid_prefix=...)`):
    run j of group i sends engine requests with rids f"{rid_prefix}-{i}-{j}-...", so the pool's abort of the call
    (an engine failed elsewhere, the quota is reached) reaches the agents' requests too."""
    if n < 1:
        raise ValueError(f"agent_group_fn: n must be >= 1, got {n}")

    async def fn(index: int, client: EngineClient) -> list[Trajectory]:
        server = server_of(client)
        if server.front.client is not client:
            raise EngineError("the OpenAI front on this rank serves another engine client than the pool's")
        store = server.front.sessions
        sids = [store.create(rid_prefix=f"{rid_prefix}-{index}-{j}-").id for j in range(n)]
        try:
            rewards = await asyncio.gather(*(agent(f"{server.url}/sessions/{sid}/v1", server.api_key or "none",
                                                   samples[index]) for sid in sids))
            return [session_trajectory(store, sid, r) for sid, r in zip(sids, rewards)]
        finally:
            for sid in sids:  # an agent that raised leaves no open session behind
                try:
                    store.take(sid)
                except Exception:  # noqa: BLE001 - already taken
                    pass
    return fn


class FrontRegistry:
    """One running front per engine client in this process, started on first use (the leader's thread)."""

    def __init__(self, make: Callable[[EngineClient], FrontServer]):
        self._make = make
        self._servers: dict[int, FrontServer] = {}

    def __call__(self, client: EngineClient) -> FrontServer:
        srv = self._servers.get(id(client))
        if srv is None:
            srv = self._make(client)
            srv.start()
            self._servers[id(client)] = srv
        return srv

    def stop(self) -> None:
        for srv in self._servers.values():
            srv.stop()
        self._servers.clear()
