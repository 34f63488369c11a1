"""ToolServer: the tools of a run, one isolated session per trajectory, calls that never crash the rollout.

    server = ToolServer([PythonTool(), RetrievalTool(), CalculatorTool()], timeout_s=10)
    async with server.session("traj-3") as s:        # create_session ... release_session, on every exit path
        result = await server.call(s, "calculator", '{"expression": "12*34"}')
        result.content -> "408"   (or an error message for the model: result.ok is False)
        reward = server.calc_reward(s)

A call's failure of any kind (unknown tool, arguments that are not JSON or do not fit the schema, the tool
raising, the call running past `timeout_s`) comes back as a ToolResult with ok=False and a message for the
model: a rollout never dies of a tool. Tool code runs in worker threads (`max_workers` at once), so blocking
tools (a sandbox subprocess, a BM25 query) do not stall the event loop that drives generation.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from mtrain.tools.base import BaseTool, ToolError, ToolSession, check_arguments, check_schema
from mtrain.tools.parsers import load_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    name: str
    ok: bool
    content: str  # what the model sees in the tool message
    error_kind: str | None = None  # unknown_tool | bad_arguments | tool_error | crash | timeout


class ToolServer:
    def __init__(self, tools: list[BaseTool], *, timeout_s: float = 10.0, max_output_chars: int = 2000,
                 max_workers: int = 8):
        if not tools:
            raise ValueError("ToolServer: no tools")
        if not timeout_s > 0 or not max_output_chars > 0:
            raise ValueError(f"ToolServer: timeout_s and max_output_chars must be > 0, got {timeout_s}, {max_output_chars}")
        self.tools: dict[str, BaseTool] = {}
        for t in tools:
            if not isinstance(t, BaseTool):
                raise TypeError(f"ToolServer: {t!r} is not a BaseTool")
            name = check_schema(t.schema)
            if name in self.tools:
                raise ValueError(f"ToolServer: two tools named {name!r}")
            self.tools[name] = t
        self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="mtrain-tool")
        self._lock = threading.Lock()
        self._open: dict[str, ToolSession] = {}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    @property
    def open_sessions(self) -> list[str]:
        with self._lock:
            return list(self._open)

    # ------------------------------------------------------------------ sessions
    def create_session(self, session_id: str) -> ToolSession:
        with self._lock:
            if session_id in self._open:
                raise ValueError(f"ToolServer: session {session_id!r} is already open")
            session = ToolSession(session_id)
            self._open[session_id] = session
        created: list[BaseTool] = []
        try:
            for t in self.tools.values():
                session.state[t.name] = t.create(session)
                created.append(t)
        except BaseException:
            self._release(session, created)
            raise
        return session

    def release_session(self, session: ToolSession) -> None:
        """Idempotent. Every tool's `release` runs even if an earlier one raises (the first error is re-raised)."""
        self._release(session, list(self.tools.values()))

    def _release(self, session: ToolSession, tools: list[BaseTool]) -> None:
        with self._lock:
            if session.released:
                return
            session.released = True
            self._open.pop(session.id, None)
        first: BaseException | None = None
        for t in tools:
            try:
                t.release(session)
            except BaseException as e:  # noqa: BLE001 - release the others, then report
                log.error("tool %s: release of session %s failed: %s", t.name, session.id, e)
                first = first or e
        if first is not None:
            raise first

    @contextlib.asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[ToolSession]:
        s = self.create_session(session_id)
        try:
            yield s
        finally:  # normal end, exception, cancellation (abort, timeout of the caller)
            self.release_session(s)

    # ------------------------------------------------------------------ calls
    async def call(self, session: ToolSession, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        if session.released:
            raise ValueError(f"ToolServer.call: session {session.id!r} was released")
        result = await self._call(session, name, arguments)
        session.calls.append({"name": name, "arguments": arguments, "ok": result.ok, "output": result.content,
                              "error_kind": result.error_kind})
        return result

    async def _call(self, session: ToolSession, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(name, False, f"Error: unknown tool {name!r}; available: {sorted(self.tools)}",
                              "unknown_tool")
        args, why = load_json(arguments) if isinstance(arguments, str) else (arguments, None)
        if why is not None:  # too deep, too large an integer, or not JSON: the model's mistake, never an exception
            return ToolResult(name, False, f"Error: arguments of {name}: {why}", "bad_arguments")
        try:
            args = check_arguments(tool.schema, args)
        except ToolError as e:
            return ToolResult(name, False, f"Error: {e}", "bad_arguments")
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, tool.call, session, args)
        try:
            out = await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            # The worker thread cannot be killed: tools with unbounded work must bound it themselves (the python
            # sandbox has its own wall-clock limit below this one).
            return ToolResult(name, False, f"Error: {name} timed out after {self.timeout_s:g} s", "timeout")
        except ToolError as e:
            return ToolResult(name, False, f"Error: {e}", "tool_error")
        except Exception as e:  # noqa: BLE001 - a broken tool is the model's problem to see, not a crash
            log.warning("tool %s raised %s: %s", name, type(e).__name__, e)
            return ToolResult(name, False, f"Error: {name} failed: {type(e).__name__}: {e}", "crash")
        if not isinstance(out, str):
            return ToolResult(name, False, f"Error: {name} returned {type(out).__name__}, not text", "crash")
        if len(out) > self.max_output_chars:
            out = out[:self.max_output_chars] + f"\n[... truncated {len(out) - self.max_output_chars} characters]"
        return ToolResult(name, True, out)

    def calc_reward(self, session: ToolSession) -> dict[str, float]:
        """Each tool's reward for this session (tool name -> what the tool returned; the rollout checks that it is a
        finite number, naming the tool: `mtrain.data.rewards.finite_reward`)."""
        return {name: t.calc_reward(session) for name, t in self.tools.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
