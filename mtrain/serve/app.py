"""The HTTP routes of the OpenAI front (FastAPI): the OpenAI API under /v1 and under /sessions/{id}/v1.

    POST /sessions                         -> {"id", "base_url"}: a new recorded session
    GET  /sessions/{id}                    -> its summary (calls, branches, rerendered, reward; ?tokens=1 the tokens)
    POST /sessions/{id}/reward  {"reward"} -> attach the session's reward
    DELETE /sessions/{id}                  -> drop it (serving alone: sessions nobody collects)
    POST /sessions/{id}/v1/chat/completions, /sessions/{id}/v1/completions, GET .../v1/models
    POST /v1/chat/completions, /v1/completions, GET /v1/models: served, not recorded

Every failure is one OpenAI-style error object ({"error": {"message", "type", "param", "code"}}): 400 for bodies
that are not JSON or fail validation (unknown fields, bad types, too long a prompt), 401 for a wrong key, 404 for
an unknown model or session, 413 for an oversized body, 429 when `max_concurrency` requests are already running,
503 when the engine fails the request (shut down, dead).
A streamed call (`stream: true`) is checked and started before its 200 goes out, so the errors above still apply;
a failure after its first chunk is an SSE error event (mtrain/serve/sse.py).
The handlers never let an exception escape to the server: anything unexpected is a 500 error object and the
next request is served as usual.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import weakref
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, ValidationError
from starlette.requests import ClientDisconnect

from mtrain.data.rewards import RewardError, finite_reward
from mtrain.rollout.protocol import EngineError
from mtrain.serve.front import Choice, OpenAIFront, Result
from mtrain.serve.schemas import ChatRequest, CompletionRequest, FrontError
from mtrain.serve.sse import StreamedCall, chat_events, completion_events
from mtrain.serve.streaming import legacy_top, token_entry

log = logging.getLogger(__name__)


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: StrictFloat | StrictInt


def _is_json(content_type: str | None) -> bool:
    """application/json (any parameters) or a +json type. A missing header is taken as JSON (a client that names
    no type); text/plain, forms and the rest are refused (415): a body is parsed only as what it says it is."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_constant(name: str):
    """NaN, Infinity and -Infinity are not JSON (RFC 8259); Python's parser takes them unless told not to."""
    raise ValueError(f"{name} is not a JSON value (numbers must be finite)")


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = first.get("msg", str(e))
    if first.get("type") == "extra_forbidden":
        msg = "unknown field (not supported by this server)"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {msg}{more}" if loc else f"{msg}{more}", loc or None


def _token_text(front: OpenAIFront, token: int) -> str:
    return front.tokenizer.decode([token], skip_special_tokens=False)


def _logprobs_content(front: OpenAIFront, ch: Choice) -> list[dict[str, Any]]:
    tops = ch.top_logprobs or [None for _ in ch.output_ids]
    return [token_entry(front.tokenizer, t, lp, top) for t, lp, top in zip(ch.output_ids, ch.logprobs, tops)]


def _legacy_top_logprobs(front: OpenAIFront, ch: Choice) -> list[dict[str, float]] | None:
    """The completions API's per-token {token text: logprob} of the most likely tokens."""
    if ch.top_logprobs is None:
        return None
    return [legacy_top(front.tokenizer, top) for top in ch.top_logprobs]


def build_app(front: OpenAIFront, *, api_key: str | None, max_body_bytes: int = 4 << 20,
              max_concurrency: int = 256, base_url: str = "", read_timeout_s: float = 30.0) -> FastAPI:
    app = FastAPI(title="mtrain OpenAI front", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.running = 0
    app.state.base_url = base_url
    app.state.stopping = False
    app.state.streams = weakref.WeakSet()  # open streamed calls (a stream nobody iterates is collected)

    async def drain(grace_s: float) -> int:
        """Stop taking requests, give running ones `grace_s` to finish, then end every stream still open with an
        error event. Returns how many streams were interrupted. Runs on the server's loop (FrontServer.stop)."""
        app.state.stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while (app.state.running or len(app.state.streams)) and loop.time() < end:
            await asyncio.sleep(0.02)
        open_calls = list(app.state.streams)
        app.state.grace_over.set()  # calls still waiting (non-streamed, or before their first token): a 503
        for call in open_calls:
            call.interrupt(f"the server is stopping (its {grace_s:g} s grace period is over)")
        end = loop.time() + 2.0  # the generators send their error event and end; the waiting calls answer
        while (app.state.running or len(app.state.streams)) and loop.time() < end:
            await asyncio.sleep(0.01)
        return len(open_calls)
    app.state.drain = drain
    app.state.grace_over = asyncio.Event()

    async def unless_stopped(aw):
        """Await `aw` (a call's generation, or a stream's first token) unless the server's grace period ends
        first: then the call is cancelled (its engine requests aborted) and answered with an OpenAI-shaped 503,
        not left to uvicorn's cut-off (a plain-text 500 or a dropped connection, and a traceback in the log)."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(app.state.grace_over.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away
            task.cancel()
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):  # its own cancellation, or what it raised on the way out
            await task
        raise FrontError(503, "the server stopped before this call finished (its grace period is over)",
                         type="server_error", code="server_shutting_down")

    def error(e: FrontError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(FrontError)
    async def _front_error(_, e: FrontError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):  # a query or path parameter (`?tokens=abc`): one line
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ())]
        where = f"{'.'.join(loc[1:])} ({loc[0]})" if len(loc) > 1 else ".".join(loc)
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return error(FrontError(400, f"{where}: {first.get('msg', 'invalid')}{more}", param=".".join(loc[1:]) or None))

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return error(FrontError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _method(request: Request, _):
        return error(FrontError(405, f"method {request.method} is not allowed on {request.url.path}"))

    @app.exception_handler(EngineError)
    async def _engine(_, e: EngineError):
        log.warning("OpenAI front: engine error: %s", e)
        return error(FrontError(503, f"the engine could not serve this request: {e}", type="server_error",
                                code="engine_unavailable"))

    @app.exception_handler(Exception)
    async def _any(_, e: Exception):
        log.exception("OpenAI front: unexpected error")
        return error(FrontError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key is not None:
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return error(FrontError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                        type="authentication_error", code="invalid_api_key"))
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return error(FrontError(413, f"request body larger than {max_body_bytes} bytes", code="too_large"))
        if app.state.stopping:
            return error(FrontError(503, "the server is stopping", type="server_error", code="server_shutting_down"))
        if app.state.running >= max_concurrency:
            return error(FrontError(429, f"{max_concurrency} requests are already running; retry later",
                                    type="rate_limit_error", code="too_many_requests"))
        app.state.running += 1
        try:
            return await call_next(request)
        finally:
            app.state.running -= 1

    async def body_of(request: Request, model: type[BaseModel]):
        if not _is_json(request.headers.get("content-type")):
            raise FrontError(415, f"the request body must be JSON (Content-Type: application/json), got "
                             f"{request.headers.get('content-type')!r}", code="unsupported_media_type")
        try:
            raw = await asyncio.wait_for(request.body(), read_timeout_s)
        except asyncio.TimeoutError:
            raise FrontError(408, f"the request body did not arrive within {read_timeout_s:g} s",
                             code="timeout") from None
        except ClientDisconnect:  # a client gone mid-body is ordinary: no traceback (nobody reads the answer)
            raise FrontError(400, "the client closed the connection before its request body arrived",
                             code="client_disconnected") from None
        if len(raw) > max_body_bytes:  # chunked bodies carry no content-length
            raise FrontError(413, f"request body larger than {max_body_bytes} bytes", code="too_large")
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: absurdly deep nesting
            raise FrontError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}",
                             code="invalid_json") from e
        if not isinstance(data, dict):
            raise FrontError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise FrontError(400, msg, param=param) from e

    async def streamed(job) -> StreamedCall:
        """Start a streamed call. It keeps a slot of `max_concurrency` until its engine work ends (the handler, which
        the middleware counts, returns as soon as the stream starts)."""
        call = StreamedCall(front, job)
        await unless_stopped(call.start())
        app.state.running += 1
        app.state.streams.add(call)

        def release(_):
            app.state.running -= 1
        call.task.add_done_callback(release)
        return call

    async def tracked(call: StreamedCall, events):
        """The stream's events; it counts as open (for `drain`) until its last event is sent."""
        try:
            async for e in events:
                yield e
        finally:
            app.state.streams.discard(call)
            await events.aclose()

    def session_of(sid: str | None):
        if sid is None:
            return None
        s = front.sessions.get(sid)
        front.sessions.check_room(s)
        return s

    def usage(res: Result) -> dict[str, int]:
        out = sum(len(c.output_ids) for c in res.choices)
        return {"prompt_tokens": len(res.prompt_ids), "completion_tokens": out,
                "total_tokens": len(res.prompt_ids) + out}

    # -- sessions ---------------------------------------------------------------------------------------------
    @app.post("/sessions")
    async def new_session(request: Request):
        s = front.sessions.create()
        return {"id": s.id, "base_url": f"{app.state.base_url}/sessions/{s.id}/v1"}

    @app.get("/sessions/{sid}")
    async def get_session(sid: str, tokens: int = 0):
        return front.sessions.get(sid).summary(with_tokens=bool(tokens))

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str):
        front.sessions.take(sid)
        return {"id": sid, "deleted": True}

    @app.post("/sessions/{sid}/reward")
    async def set_reward(sid: str, request: Request):
        front.sessions.get(sid)  # 404 before reading a body for nothing
        value = (await body_of(request, RewardBody)).reward
        try:  # before anything is stored: a NaN would break GET /sessions/{id} and poison a batch
            reward = finite_reward(value, "reward")
        except RewardError:
            raise FrontError(400, f"reward: {str(value)[:40]} is not a finite number (a float64)", param="reward",
                             code="invalid_reward") from None
        # checked again now the body is in: the session may have been deleted or taken while it arrived; one
        # reward per session (a silent replacement would hide a buggy agent)
        return {"id": sid, "reward": front.sessions.set_reward(sid, reward).reward}

    # -- the OpenAI API ---------------------------------------------------------------------------------------
    def models():
        return {"object": "list", "data": [{"id": front.model_name, "object": "model", "created": 0,
                                            "owned_by": "mtrain"}]}

    async def chat(request: Request, sid: str | None):
        session = session_of(sid)
        req = await body_of(request, ChatRequest)
        job = front.prepare_chat(req, session)
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if req.stream:
            call = await streamed(job)
            return StreamingResponse(tracked(call, chat_events(call, req, cid, created, usage)),
                                     media_type="text/event-stream")
        res = await unless_stopped(front.run(job))
        choices = []
        for ch in res.choices:
            msg: dict[str, Any] = {"role": "assistant", "content": ch.content}
            if ch.tool_calls:
                msg["tool_calls"] = ch.tool_calls
            choices.append({"index": ch.index, "message": msg, "finish_reason": ch.finish_reason,
                            "logprobs": {"content": _logprobs_content(front, ch)} if req.logprobs else None})
        return {"id": cid, "object": "chat.completion", "created": created, "model": front.model_name,
                "choices": choices, "usage": usage(res)}

    async def completions(request: Request, sid: str | None):
        session = session_of(sid)
        req = await body_of(request, CompletionRequest)
        job = front.prepare_complete(req, session)
        cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        if req.stream:
            call = await streamed(job)
            return StreamingResponse(tracked(call, completion_events(call, req, cid, created, usage)),
                                     media_type="text/event-stream")
        res = await unless_stopped(front.run(job))

        def lp(ch: Choice):
            if req.logprobs is None:
                return None
            toks = [_token_text(front, t) for t in ch.output_ids]
            return {"tokens": toks, "token_logprobs": [float(x) for x in ch.logprobs],
                    "top_logprobs": _legacy_top_logprobs(front, ch), "text_offset": None}

        choices = [{"index": ch.index, "text": ch.text, "finish_reason": ch.finish_reason, "logprobs": lp(ch)}
                   for ch in res.choices]
        return {"id": cid, "object": "text_completion", "created": created, "model": front.model_name,
                "choices": choices, "usage": usage(res)}

    @app.get("/metrics")
    async def metrics():
        """Counters for a server left running (`mtrain serve`): open and expired sessions, calls and streams."""
        return {"sessions_open": len(front.sessions), "sessions_expired": front.sessions.expired,
                "sessions_max": front.sessions.max_sessions, "sessions_ttl_s": front.sessions.ttl_s,
                "session_max_tokens": front.sessions.max_session_tokens,
                "sessions_refused_full": front.sessions.refused_full,
                "requests_running": app.state.running, "streams_open": len(app.state.streams)}

    @app.get("/v1/models")
    async def _models():
        return models()

    @app.get("/sessions/{sid}/v1/models")
    async def _session_models(sid: str):
        session_of(sid)
        return models()

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat(request, None)

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def _session_chat(request: Request, sid: str):
        return await chat(request, sid)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(request, None)

    @app.post("/sessions/{sid}/v1/completions")
    async def _session_completions(request: Request, sid: str):
        return await completions(request, sid)

    return app
