"""The rollout pool: every engine of the job serves one shared queue of GRPO groups.

Every rank holds a `RolloutPool`; the leader of each engine group also holds that group's engine. `run(n, fn)` is a
collective: the leaders claim group indices from one counter in torchrun's c10d store (`store.add` is atomic, so
each index goes to exactly one engine, and a slow engine simply claims fewer), run `await fn(index, client)` for up
to `max_groups_in_flight` groups at a time on their own engine, and then every rank receives every group's result,
in index order (one `all_gather_object`). Results do not depend on which engine served a group: every request
carries its own seed.

Failure: a leader whose group function raises writes the message under the call's error key in the store; every
other leader polls that key while it works and aborts its own requests when it appears, so the collective ends
within about a poll interval plus one decoding step, and every rank raises the same EngineError.

Timeline: every engine records when each group function started and ended, how many group slots it ran
(`slots`) and when its queue drained (the first time one of its slots found no group left to claim, or the quota
stopped claiming). From these, `tail_wait_frac` (module function) is the share of the engines' slot-time in the
rollout window spent empty after the queue drained: engines waiting for the longest groups (issue 11's metric).

Why the c10d store: torchrun already runs it (no Ray, no HTTP, no extra port), it is reachable from every rank
without a collective (a leader must not wait for others to claim), and `add` is an atomic fetch-and-add. Keys are
namespaced per call and deleted when the call ends.
"""
from __future__ import annotations

import asyncio
import pickle
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch.distributed as dist

from mtrain.rollout.client import EngineClient, LocalClient
from mtrain.rollout.groups import EngineGroups
from mtrain.rollout.protocol import EngineError, RolloutEngine

GroupFn = Callable[[int, EngineClient], Awaitable[Any]]
POLL_S = 0.05


@dataclass
class PoolRun:
    results: list[Any]  # per group index (None: never started, when a quota stopped the call)
    served: list[int]  # groups served, per engine
    seconds: float  # the slowest engine's
    tickets: dict[int, int] | None = None  # quota runs: group index -> its place (1, 2, ...) among counted groups
    timelines: list["EngineTimeline"] | None = None  # one per engine, times from that engine's start

    def metrics(self) -> dict[str, float]:
        out = {"rollout/engines": float(sum(1 for s in self.served if s)),
               "rollout/groups_per_engine_min": float(min(self.served)),
               "rollout/groups_per_engine_max": float(max(self.served))}
        if self.timelines:
            out["perf/tail_wait_frac"] = tail_wait_frac(self.timelines)
            out["rollout/slots"] = float(sum(t.slots for t in self.timelines))
            quota_at = [t.quota_s for t in self.timelines if t.quota_s is not None]
            if quota_at:  # from the quota being met to the last aborted group coming back
                out["time/abort_wait"] = max(t.end_s for t in self.timelines) - min(quota_at)
        return out


@dataclass
class EngineTimeline:
    """One engine's view of one pool call, in seconds from the moment it started claiming (right after the
    call's barrier, so the engines' clocks agree to within the barrier's skew)."""
    slots: int  # groups it ran at once at most (its workers)
    spans: list[tuple[float, float]]  # (start, end) of every group function it ran
    drain_s: float  # first time a slot found nothing left to claim (queue empty or the quota met)
    end_s: float  # its last group function returned
    quota_s: float | None = None  # when it learned the quota was met (quota runs)


def tail_wait_frac(timelines: list[EngineTimeline]) -> float:
    """Share of the engines' slot-time in the rollout window [0, T] spent empty after each engine's queue drained.

    T is the end of the slowest engine (the step waits for it). Engine e with W_e slots, in-flight count g_e(t) and
    drain time d_e waits for the tail for  (1/W_e) * integral_{d_e}^{T} (W_e - g_e(t)) dt  seconds; the fraction is
    the sum over engines divided by (engines x T). Before d_e an empty slot is only between a finished group and the
    next claim, not waiting for the tail. An engine that finished early counts as idle until T."""
    if not timelines:
        return 0.0
    end = max(t.end_s for t in timelines)
    if end <= 0:
        return 0.0
    idle = 0.0
    for t in timelines:
        d = min(t.drain_s, end)
        busy = sum(max(0.0, min(b, end) - max(a, d)) for a, b in t.spans)
        idle += (end - d) - busy / max(t.slots, 1)
    return max(0.0, idle / (len(timelines) * end))


def default_store():
    """torchrun's c10d store (the one init_process_group rendezvoused through)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class RolloutPool:
    def __init__(self, groups: EngineGroups, rank: int, engine: RolloutEngine | None, *, max_groups_in_flight: int,
                 store=None, namespace: str = "mtrain/pool", process_group=None):
        if groups.is_leader(rank) != (engine is not None):
            raise EngineError(f"rank {rank}: an engine group's leader must hold its engine and no other rank may "
                              f"({'leader' if groups.is_leader(rank) else 'not a leader'}, engine="
                              f"{type(engine).__name__ if engine else None})")
        if max_groups_in_flight < 1:
            raise EngineError(f"max_groups_in_flight must be >= 1, got {max_groups_in_flight}")
        self.groups, self.rank, self.engine = groups, rank, engine
        self.max_in_flight = max_groups_in_flight
        self.store = store if store is not None else default_store()
        self.namespace = namespace
        # A pool driven from a thread of its own (rollout.async) gathers over its own gloo group, never the one the
        # training collectives use at the same time (mtrain/trainer/sources/one_step.py).
        self.pg = process_group
        self.client = LocalClient(engine) if engine is not None else None
        self._calls = 0

    def run(self, n: int, fn: GroupFn, *, rid_prefix: str, quota: int | None = None,
            in_flight: int | None = None) -> PoolRun:
        """Run fn(index, client) for index in range(n) across the engines (collective over all ranks).

        quota: fn returns (counts, value); once `quota` groups returned counts=True (over all engines, in the order
        of a store counter: their tickets), every engine stops claiming and aborts its running requests of this
        call, whose group functions then return their partial state (partial rollout). Groups never started are
        None in the results.

        in_flight: groups run at once over the whole pool (each engine runs its share, at most max_groups_in_flight);
        default n. With n > in_flight a finished group's slot takes the next index at once, so the engines stay full
        until the queue runs dry (partial rollout passes a reserve of groups beyond what it keeps in flight)."""
        key = f"{self.namespace}/{self._calls}"
        self._calls += 1
        # every engine starts claiming together: the first one ready must not take the whole queue
        dist.barrier(group=self.pg)
        mine: dict[int, Any] = {}
        error: Exception | _Echo | None = None
        seconds = 0.0
        timeline = None
        if self.engine is not None:
            t0 = time.perf_counter()
            mine, error, timeline = asyncio.run(self._drive(n, fn, key, rid_prefix, quota, in_flight or n))
            seconds = time.perf_counter() - t0
        gathered: list = [None] * dist.get_world_size(self.pg)
        arrived = f"{key}/arrived/{self.rank}"  # who reached the gather: a rank that never does is named
        self.store.set(arrived, "1")
        try:
            dist.all_gather_object(gathered, (self.rank, mine, error, seconds, timeline), group=self.pg)
        except Exception as e:  # noqa: BLE001 - a dead or hung rank (the collective's timeout): say which
            raise EngineError(self._absent(key, rid_prefix, e)) from e
        self.store.delete_key(arrived)
        if self.rank == 0:
            for suffix in ("next", "error", "done", "quota"):
                self.store.delete_key(f"{key}/{suffix}")
        errors = [(r, e) for r, _, e, _, _ in gathered if e is not None]
        if errors:
            # The cause, not its echoes (engines that aborted because another failed), raised as itself: a
            # RewardError stays a RewardError on every rank, with a note saying where it happened.
            r, exc = min(errors, key=lambda x: (isinstance(x[1], _Echo), x[0]))
            where = f"rollout {rid_prefix}: engine {self.groups.group_of(r)} (rank {r}) failed"
            if isinstance(exc, _Echo):
                raise EngineError(f"{where}: {exc}")
            exc.add_note(where)
            raise exc
        results: list[Any] = [None] * n
        served = [0] * self.groups.count
        for r, got, _, _, _ in gathered:
            for i, value in got.items():
                results[i] = value
            if got:
                served[self.groups.group_of(r)] += len(got)
        seconds = max(s for _, _, _, s, _ in gathered)  # the slowest engine's time, the same number on every rank
        timelines = [t for _, _, _, _, t in gathered if t is not None]
        if quota is not None:
            tickets = {i: v[0] for i, v in enumerate(results) if v is not None and v[0] is not None}
            return PoolRun([None if v is None else v[1] for v in results], served, seconds, tickets, timelines)
        missing = [i for i, v in enumerate(results) if v is None]
        if missing:
            raise EngineError(f"rollout {rid_prefix}: groups {missing[:5]} were claimed by no engine")
        return PoolRun(results, served, seconds, timelines=timelines)

    def _absent(self, key: str, rid_prefix: str, cause: Exception) -> str:
        ranks = dist.get_process_group_ranks(self.pg) if self.pg is not None else range(dist.get_world_size())
        missing = [r for r in ranks if not self.store.check([f"{key}/arrived/{r}"])]
        who = ", ".join(f"rank {r} (engine {self.groups.group_of(r)})" for r in missing) or "no rank missing"
        return (f"rollout {rid_prefix}: {who} did not reach the end of the rollout (dead or hung; bounded by "
                f"train.collective_timeout_s): {type(cause).__name__}: {str(cause)[:200]}")

    async def _drive(self, n: int, fn: GroupFn, key: str, rid_prefix: str, quota: int | None,
                     in_flight: int) -> tuple[dict[int, Any], Exception | None, EngineTimeline]:
        results: dict[int, Any] = {}
        state: dict[str, Any] = {"error": None, "drain": None, "quota": None}
        stop = asyncio.Event()
        t0 = time.perf_counter()
        spans: list[tuple[float, float]] = []

        def now() -> float:
            return time.perf_counter() - t0

        def quota_met() -> None:
            if state["quota"] is None:
                state["quota"] = now()
            stop.set()  # enough groups: the running ones stop and come back partial
            self.engine.abort(rid_prefix)

        async def worker() -> None:
            try:
                await claim_and_run()
            finally:
                if state["drain"] is None:
                    state["drain"] = now()

        async def claim_and_run() -> None:
            while not stop.is_set():
                i = await asyncio.to_thread(self.store.add, f"{key}/next", 1) - 1
                if i >= n or stop.is_set():
                    return
                start = now()
                try:
                    value = await fn(i, self.client)
                    if quota is not None:  # (counts, value) -> (ticket or None, value)
                        counts, value = value
                        ticket = None
                        if counts:
                            ticket = await asyncio.to_thread(self.store.add, f"{key}/done", 1)
                            if ticket >= quota:
                                self.store.set(f"{key}/quota", "met")
                                quota_met()  # this engine aborts now; the others within a poll interval
                        value = (ticket, value)
                    results[i] = value
                    spans.append((start, now()))
                except Exception as e:  # noqa: BLE001 - reported to every rank by run()
                    if state["error"] is None and not stop.is_set():
                        state["error"] = _picklable(e)
                        self.store.set(f"{key}/error", f"{type(e).__name__}: {e}")
                    stop.set()
                    self.engine.abort(rid_prefix)
                    return

        finished = asyncio.Event()

        async def watch() -> None:
            """Another engine failed or the quota was met: stop claiming and abort this engine's requests of this
            rollout; then keep aborting until the workers are done (a group function between its claim and its
            requests' submission would otherwise start requests that nobody aborts: a new tail)."""
            while not finished.is_set():
                if not stop.is_set():
                    if await asyncio.to_thread(self.store.check, [f"{key}/error"]):
                        if state["error"] is None:
                            state["error"] = _Echo("aborted: another engine failed")
                        stop.set()
                    elif quota is not None and await asyncio.to_thread(self.store.check, [f"{key}/quota"]):
                        quota_met()
                if stop.is_set():
                    self.engine.abort(rid_prefix)
                try:
                    await asyncio.wait_for(finished.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass

        watcher = asyncio.create_task(watch())
        # No more workers than an even share: with few groups, the first engine to reach the store must not claim
        # them all at once (later claims still go to whichever engine is free first).
        workers = max(1, min(self.max_in_flight, -(-min(n, in_flight) // self.groups.count)))
        await asyncio.gather(*(worker() for _ in range(workers)))
        end = now()
        stop.set()
        finished.set()
        await watcher
        return results, state["error"], EngineTimeline(workers, spans, state["drain"], end, state["quota"])


class _Echo(str):
    """This engine stopped because another failed: not the cause."""


def _picklable(e: Exception) -> Exception:
    """The exception itself when it survives pickling (it travels to every rank), else an EngineError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return EngineError(f"{type(e).__name__}: {e}")
