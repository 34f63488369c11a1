"""Sessions: every call an agent makes through the front, recorded as exact tokens (token-in-token-out).

A session is a tree of branches. A branch is one conversation as a `Trajectory` (prompt, model turns with the
engine's own ids, logprobs and per-token weight versions, environment segments with what the client appended),
ending with a model turn. A new call whose messages extend a branch's messages (that branch's conversation,
including the assistant reply we returned, is a prefix of the request) continues it: its prompt is that branch's
tokens plus only the appended messages rendered by the template (`tito.suffix`), so the model's tokens are never
re-tokenized. A call that extends no branch (a new conversation, or a client that edited the history) starts a
new root branch from a full rendering: it is counted (`rerendered`) and reported, never silently merged.
With n > 1 every choice is a branch of its own. The branches nothing continued (leaves) are the session's
trajectories; the session's reward applies to each.
"""
from __future__ import annotations

import copy
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mtrain.rollout.trajectory import Segment, Trajectory
from mtrain.serve.schemas import FrontError


@dataclass
class Branch:
    id: int
    messages: list[dict[str, Any]]  # the conversation, ending with the assistant reply we returned
    tools_key: str  # the tools the conversation was rendered with (a changed tool list cannot extend it)
    trajectory: Trajectory
    stop_text: str | None  # the decoded stop token the last model turn ended with (None: no stop token)
    parent: int | None
    rerendered: bool  # started from a full rendering although the session already had branches
    leaf: bool = True


@dataclass
class Plan:
    """How a call's prompt is built: extend `parent` with `env` ids, or (parent None) a fresh rendering."""

    parent: Branch | None
    prompt_ids: list[int]
    env_ids: list[int]  # the appended messages' tokens (continuations only)
    env_text: str
    rerendered: bool = False  # a fresh rendering although the session already had branches (edited history)

    def routed_experts_start(self, version: int) -> int:
        """Routing replay, for a call on weight `version`: the first position whose routing the parent branch lacks,
        so the call asks the engine only for the rows past those the branch already holds; 0 (every row) for a fresh
        rendering, and when the branch's rows were routed under other weights (a session continued across a weight
        sync: `Trajectory.routing_request_start`)."""
        if self.parent is None:
            return 0
        return self.parent.trajectory.routing_request_start(version)


@dataclass
class Session:
    id: str
    created: float = field(default_factory=time.time)
    branches: list[Branch] = field(default_factory=list)
    reward: float | None = None
    calls: int = 0
    closed: bool = False
    recorded_tokens: int = 0  # every branch's trajectory tokens (what the session holds); bounded by the store
    rid_prefix: str = ""  # the engine rids of this session's calls start with it (the pool aborts by prefix)
    last_used: float = field(default_factory=time.monotonic)  # for the store's ttl: creation or the latest lookup

    def leaves(self) -> list[Branch]:
        return [b for b in self.branches if b.leaf]

    def summary(self, with_tokens: bool = False) -> dict[str, Any]:
        out = {"id": self.id, "calls": self.calls, "branches": len(self.branches),
               "leaves": len(self.leaves()), "rerendered": sum(b.rerendered for b in self.branches),
               "reward": self.reward}
        if with_tokens:
            out["trajectories"] = [
                {"branch": b.id, "parent": b.parent, "finish_reason": b.trajectory.finish_reason,
                 "segments": [{"kind": s.kind, "ids": s.ids, "logprobs": s.logprobs, "versions": s.versions}
                              for s in b.trajectory.segments]} for b in self.leaves()]
        return out


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class SessionStore:
    """Thread-safe: the HTTP loop records while the trainer's thread creates and takes sessions."""

    def __init__(self, max_sessions: int = 100_000, ttl_s: float | None = None,
                 max_session_tokens: int = 4_000_000):
        """ttl_s: a session nobody used (created, looked up by a call or a GET) for this long is dropped, counted
        in `expired` (`mtrain serve`, where no trainer takes them); None = kept until taken. max_session_tokens:
        the tokens one session may record (`check_room`); calls refused for it are counted in `refused_full`."""
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.max_sessions, self.ttl_s, self.max_session_tokens = max_sessions, ttl_s, max_session_tokens
        self.expired = 0
        self.refused_full = 0
        self._swept = time.monotonic()

    def _sweep(self, now: float) -> None:  # under the lock
        if self.ttl_s is None or (now - self._swept < min(1.0, self.ttl_s / 10)
                                  and len(self._sessions) < self.max_sessions):
            return
        self._swept = now
        old = [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
        for sid in old:
            self._sessions.pop(sid).closed = True
        self.expired += len(old)

    def create(self, rid_prefix: str = "") -> Session:
        """rid_prefix: the engine request ids of the session's calls start with it, so that aborting a rollout by
        its prefix (the pool, on failure or quota) also stops its agents' calls."""
        with self._lock:
            self._sweep(time.monotonic())
            if len(self._sessions) >= self.max_sessions:
                raise FrontError(429, f"too many open sessions ({self.max_sessions}); take or delete finished ones",
                                 type="rate_limit_error", code="too_many_sessions")
            s = Session(secrets.token_urlsafe(16), rid_prefix=rid_prefix)  # unguessable: the id is the capability
            self._sessions[s.id] = s
            return s

    def get(self, sid: str) -> Session:
        now = time.monotonic()
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None and self.ttl_s is not None and now - s.last_used > self.ttl_s:
                self._sessions.pop(sid).closed = True
                self.expired += 1
            elif s is not None:
                s.last_used = now
        if s is None or s.closed:
            raise FrontError(404, f"session {sid!r} does not exist (create one with POST /sessions)",
                             param="session_id", code="session_not_found")
        return s

    def check_room(self, s: Session) -> None:
        """Refuse a call on a session that has recorded `max_session_tokens` already (409 session_full): an agent
        looping on one session must not grow the server's memory without bound."""
        if s.recorded_tokens >= self.max_session_tokens:
            with self._lock:
                self.refused_full += 1
            raise FrontError(409, f"session {s.id!r} has recorded {s.recorded_tokens} tokens, its limit "
                             f"(serve.max_session_tokens={self.max_session_tokens}); start a new session",
                             param="session_id", code="session_full")

    def set_reward(self, sid: str, reward: float) -> Session:
        """Attach the session's one reward, under the store's lock: a session deleted or taken (by the trainer)
        before this runs gets 404, never a 200 for a reward nobody will read; a second reward gets 409."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None and not s.closed and s.reward is None:
                s.reward = reward
                s.last_used = time.monotonic()
                return s
        if s is None or s.closed:
            raise FrontError(404, f"session {sid!r} does not exist (deleted, taken or expired); its reward is not "
                             f"kept", param="session_id", code="session_not_found")
        raise FrontError(409, f"session {sid!r} already has reward {s.reward}; a session takes one reward",
                         param="reward", code="reward_already_set")

    def take(self, sid: str) -> Session:
        """Remove the session and return it (the trainer collects it); later calls on it get 404."""
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is None:
            raise FrontError(404, f"session {sid!r} does not exist", param="session_id", code="session_not_found")
        s.closed = True
        return s

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


def plan_chat(session: Session | None, messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer,
              render_prompt, render_suffix) -> Plan:
    """The prompt of a chat call. render_prompt(messages, tools) -> (text, ids) renders a whole conversation;
    render_suffix(new_messages, tools, stop_text) -> (text, ids) renders only what follows a model turn."""
    if session is not None:
        key = tools_key(tools)
        best = None
        for b in session.branches:  # the longest recorded conversation that the request extends
            if b.tools_key == key and len(b.messages) < len(messages) and messages[:len(b.messages)] == b.messages:
                if best is None or len(b.messages) > len(best.messages):
                    best = b
        if best is not None:
            text, env = render_suffix(messages[len(best.messages):], tools, best.stop_text)
            return Plan(best, best.trajectory.tokens + env, env, text)
    _, ids = render_prompt(messages, tools)
    return Plan(None, ids, [], "", rerendered=bool(session is not None and session.branches))


def plan_tokens(session: Session | None, prompt_ids: list[int]) -> Plan:
    """The prompt of a /v1/completions call given as token ids: it continues the longest branch (chat or
    completion) whose tokens it starts with (the rest is the environment's), else starts a root branch. Text prompts are encoded by the
    caller and always start a root branch (matching text would mean re-tokenizing the model's output)."""
    if session is not None:
        best = None
        for b in session.branches:
            toks = b.trajectory.tokens
            if len(toks) < len(prompt_ids) and prompt_ids[:len(toks)] == toks:
                if best is None or len(toks) > len(best.trajectory.tokens):
                    best = b
        if best is not None:
            n = len(best.trajectory.tokens)
            return Plan(best, list(prompt_ids), list(prompt_ids[n:]), "")
    return Plan(None, list(prompt_ids), [], "", rerendered=bool(session is not None and session.branches))


def record(session: Session, plan: Plan, messages: list[dict[str, Any]], key: str,
           reply: dict[str, Any], output_ids: list[int], logprobs: list[float], versions: list[int], text: str,
           stop_text: str | None, finish_reason: str, routed: Any = None, routed_start: int = 0,
           routed_version: int | None = None) -> Branch:
    """Add one choice of a call as a branch. key: `tools_key(tools)` for chat, "completions" for token prompts.
    routed: the engine's routing of this call's prompt + output from position `routed_start` on, under weight
    `routed_version` (the completion's `routed_experts_start` and `weight_version`; the call asked from
    `plan.routed_experts_start(version)`) (routing replay): the branch extends its parent's rows when the call ran on
    their weights, else the call's rows (every row) replace them (`Trajectory.record_routing`). Callers hold no lock:
    only the HTTP loop's one thread records."""
    if plan.parent is not None:
        segments = copy.deepcopy(plan.parent.trajectory.segments)
        if plan.env_ids:
            segments.append(Segment("env", list(plan.env_ids), text=plan.env_text))
        plan.parent.leaf = False
        turns = plan.parent.trajectory.turns
    else:
        segments = [Segment("prompt", list(plan.prompt_ids))]
        turns = 0
    segments.append(Segment("model", list(output_ids), list(logprobs), list(versions), text))
    bid = len(session.branches)
    traj = Trajectory(rid=f"{session.id}/{bid}", segments=segments, messages=messages + [reply],
                      finish_reason=finish_reason, turns=turns + 1)
    if plan.parent is not None:
        traj.routed_experts = plan.parent.trajectory.routed_experts
        traj.routing_rows_received = plan.parent.trajectory.routing_rows_received
        traj.routing_version = plan.parent.trajectory.routing_version
    traj.record_routing(routed, routed_start, routed_version)
    b = Branch(bid, messages + [reply], key, traj, stop_text,
               plan.parent.id if plan.parent is not None else None,
               rerendered=plan.rerendered)
    session.branches.append(b)
    session.recorded_tokens += len(traj.tokens)
    return b


def trajectories(session: Session, reward: float | None = None) -> list[Trajectory]:
    """The session's leaf branches as trajectories, each carrying the session's reward (or `reward`)."""
    r = session.reward if reward is None else reward
    out = []
    for b in session.leaves():
        t = b.trajectory
        t.reward = r
        t.metrics = {"session/branches": float(len(session.branches)),
                     "session/rerendered": float(sum(x.rerendered for x in session.branches))}
        out.append(t)
    return out
