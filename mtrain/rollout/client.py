"""What rollout functions see of the engines: one awaitable call per request.

`EngineClient` is the whole contract between a rollout function (single-turn, multi-turn tools, an OpenAI-style
agent) and the engines below it. The pool's client sends each request to the engine of this engine group;
`LocalClient` wraps one engine directly (tests, tools, the OpenAI front on one engine). Both accept requests from
any event loop and any number of concurrent tasks: the engine batches them.

Streaming is not a second method: a Request may carry an `on_tokens` hook (contract in protocol.py, above
`TokenHook`), which every client passes through untouched with the request. `stream(client, request)` turns that hook
into an async iterator for asyncio callers (the OpenAI front).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Protocol, runtime_checkable

from mtrain.rollout.protocol import Completion, Request, RolloutEngine, TokenDelta


@runtime_checkable
class EngineClient(Protocol):
    async def generate(self, request: Request) -> Completion:
        """Generate one request; an aborted request returns its partial output with finish_reason "abort"."""

    def abort(self, rid_prefix: str | None = None) -> None:
        """Abort in-flight requests whose rid starts with rid_prefix (all when None)."""

    @property
    def weight_version(self) -> int:
        """The version of the weights new requests run on."""


class LocalClient:
    """An EngineClient over one engine in this process (`RolloutEngine.submit`)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    async def generate(self, request: Request) -> Completion:
        return await asyncio.wrap_future(self.engine.submit(request))

    def abort(self, rid_prefix: str | None = None) -> None:
        self.engine.abort(rid_prefix)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version


async def stream(client: EngineClient, request: Request) -> AsyncIterator[TokenDelta | Completion]:
    """Yield the request's TokenDeltas as the engine produces them, then its Completion (always last).

    The hook hops from the engine's thread onto this loop with call_soon_threadsafe, which keeps the engine's order;
    the engine calls it before resolving the request's future, so every delta is queued before the Completion.
    A consumer that stops early (client gone, task cancelled) aborts the request in the engine instead of cancelling
    the engine's future under it; the request then finishes "abort" on its own.
    """
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue = asyncio.Queue()

    def hook(delta: TokenDelta) -> None:
        loop.call_soon_threadsafe(deltas.put_nowait, delta)

    task = asyncio.ensure_future(client.generate(dataclasses.replace(request, on_tokens=hook)))
    try:
        while True:
            get = asyncio.ensure_future(deltas.get())
            try:
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                yield get.result()
                continue
            while not deltas.empty():  # queued before the future resolved
                yield deltas.get_nowait()
            yield task.result()
            return
    finally:
        if not task.done():
            client.abort(request.rid)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it now


class RecordingClient(LocalClient):
    """A LocalClient that keeps every (request, completion) it served, in completion order: the engine's own
    output, before any caller cuts it, for checks and benchmarks to compare a trajectory or an answer with."""

    def __init__(self, engine: RolloutEngine):
        super().__init__(engine)
        self.log: list[tuple[Request, Completion]] = []

    async def generate(self, request: Request) -> Completion:
        out = await super().generate(request)
        self.log.append((request, out))
        return out
