"""What rollout functions see of the engines: one awaitable call per request.

`EngineClient` is the whole contract between a rollout function (single-turn, multi-turn tools, an OpenAI-style
agent) and the engines below it. The pool's client sends each request to the engine of this engine group;
`LocalClient` wraps one engine directly (tests, tools, the OpenAI front on one engine). Both accept requests from
any event loop and any number of concurrent tasks: the engine batches them.
"""
from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from mtrain.rollout.protocol import Completion, Request, RolloutEngine


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
