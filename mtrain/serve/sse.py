"""Server-sent events of a streamed call, sent as the engine produces tokens (not after the completion is done).

`StreamedCall` starts the prepared job with a delta sink (`OpenAIFront.run(job, on_delta)`) and waits for its first
token, or its end: a request the engine refuses at once still gets a plain HTTP error (the status goes out with the
first chunk), and a call held by a weight sync simply waits. Then `chat_events` / `completion_events` turn each
choice's tokens into chunks through its `ChoiceStream` (what text is final: streaming.py), choices interleaved as
their tokens arrive, each chunk tagged with its choice's index. When the call is done, the finished Result (the same
one a non-streamed call returns and records) gives each choice the rest of its text, its `tool_calls` and its
finish_reason; `stream_options.include_usage` adds the usage chunk. An engine failure after the first chunk is an
OpenAI error event (`data: {"error": ...}`, which the openai client raises). A client that goes away cancels the
generator: the call's task is cancelled, which aborts its engine requests (client.stream). A stream still open when
the server stops past its grace period is `interrupt`ed: it ends with an error event (code
`server_shutting_down`), never as a normal end without `[DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from mtrain.rollout.protocol import TokenDelta
from mtrain.serve.front import Job, OpenAIFront, Result
from mtrain.serve.streaming import ChoiceStream, legacy_top, token_entry

log = logging.getLogger(__name__)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
_INTERRUPT = object()  # queued by `interrupt`: the stream stops where it is


class StreamedCall:
    def __init__(self, front: OpenAIFront, job: Job):
        self.front, self.job = front, job
        self.streams = [ChoiceStream(front.tokenizer, job.stops, front.stops, job.tool_marker) for _ in job.params]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: Any = None
        self.task: asyncio.Task | None = None
        self.interrupted: str | None = None  # why the stream was ended before its call (the server stopping)

    def interrupt(self, reason: str) -> None:
        """End the stream where it is (on the server's loop): the events end with an error event saying `reason`,
        never as if the call had finished; the call's engine requests are aborted when the generator ends."""
        self.interrupted = reason
        self._queue.put_nowait(_INTERRUPT)

    async def start(self) -> None:
        """Run the job and wait for its first token or its end; raises what the call raised if it ended so."""
        self.task = asyncio.ensure_future(self.front.run(self.job, lambda j, d: self._queue.put_nowait((j, d))))
        # on_delta runs on this loop before the call's result is set, so this marker comes after every delta
        self.task.add_done_callback(lambda _: self._queue.put_nowait(None))
        try:
            self._first = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if self._first is None:
            self.task.result()

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the front's per-choice streams abort their engine requests

    async def deltas(self) -> AsyncIterator[tuple[int, str, int, TokenDelta]]:
        """(choice, final text, tokens taken, its tokens) as they arrive. Deltas already queued when the loop gets
        to them are merged per choice (a busy server sends fewer, larger chunks instead of falling behind)."""
        if self._first is None or self.interrupted:
            return
        batch, ended = [self._first], False
        while True:
            while not ended and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is _INTERRUPT:
                    return
                ended = item is None  # the end marker is the last thing queued
                if not ended:
                    batch.append(item)
            merged: dict[int, list[TokenDelta]] = {}
            for j, d in batch:
                merged.setdefault(j, []).append(d)
            for j, ds in merged.items():
                d = ds[0] if len(ds) == 1 else TokenDelta(
                    [t for x in ds for t in x.output_ids], [v for x in ds for v in x.logprobs],
                    None if ds[0].top_logprobs is None else [r for x in ds for r in x.top_logprobs])
                piece, taken = self.streams[j].push(d.output_ids)
                if piece or taken:
                    yield j, piece, taken, d
            if ended:
                return
            item = await self._queue.get()
            if item is None or item is _INTERRUPT:
                return
            batch = [item]

    def result(self) -> Result:
        return self.task.result()


def _interrupted_event(reason: str) -> str:
    return sse({"error": {"message": f"the stream was ended before its completion: {reason}",
                          "type": "server_error", "param": None, "code": "server_shutting_down"}})


def _error_event(e: BaseException) -> str:
    log.warning("OpenAI front: a streamed call failed after its first chunk: %s", e)
    return sse({"error": {"message": f"the engine could not finish this request: {type(e).__name__}: {e}",
                          "type": "server_error", "param": None, "code": "engine_unavailable"}})


async def chat_events(call: StreamedCall, req, cid: str, created: int, usage) -> AsyncIterator[str]:
    front = call.front
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": front.model_name}

    def chunk(j: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        return sse({**head, "choices": [{"index": j, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

    try:
        for j in range(len(call.streams)):
            yield chunk(j, {"role": "assistant", "content": ""})
        async for j, piece, taken, d in call.deltas():
            lps = None
            if req.logprobs:
                tops = d.top_logprobs or [None] * taken
                lps = {"content": [token_entry(front.tokenizer, t, lp, top) for t, lp, top in
                                   zip(d.output_ids[:taken], d.logprobs[:taken], tops[:taken])]}
            if piece or lps:
                yield chunk(j, {"content": piece}, logprobs=lps)
        if call.interrupted:
            yield _interrupted_event(call.interrupted)
            return
        try:
            res = call.result()
        except Exception as e:  # noqa: BLE001 - the status is sent: the error goes out as an event
            yield _error_event(e)
            return
        for ch in res.choices:
            rest = call.streams[ch.index].finish(ch.content)
            if rest:
                yield chunk(ch.index, {"content": rest})
            if ch.tool_calls:
                yield chunk(ch.index, {"tool_calls": [{"index": i, **c} for i, c in enumerate(ch.tool_calls)]})
            yield chunk(ch.index, {}, ch.finish_reason)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(res)})
        yield DONE
    finally:
        call.cancel()


async def completion_events(call: StreamedCall, req, cid: str, created: int, usage) -> AsyncIterator[str]:
    front = call.front
    head = {"id": cid, "object": "text_completion", "created": created, "model": front.model_name}

    def chunk(j: int, text: str, finish: str | None = None, logprobs=None) -> str:
        return sse({**head, "choices": [{"index": j, "text": text, "finish_reason": finish, "logprobs": logprobs}]})

    try:
        async for j, piece, taken, d in call.deltas():
            lps = None
            if req.logprobs is not None:
                ids = d.output_ids[:taken]
                lps = {"tokens": [front.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                       "token_logprobs": [float(x) for x in d.logprobs[:taken]],
                       "top_logprobs": [legacy_top(front.tokenizer, top) for top in d.top_logprobs[:taken]]
                       if d.top_logprobs is not None else None, "text_offset": None}
            if piece or lps:
                yield chunk(j, piece, logprobs=lps)
        if call.interrupted:
            yield _interrupted_event(call.interrupted)
            return
        try:
            res = call.result()
        except Exception as e:  # noqa: BLE001
            yield _error_event(e)
            return
        for ch in res.choices:
            yield chunk(ch.index, call.streams[ch.index].finish(ch.text), ch.finish_reason)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(res)})
        yield DONE
    finally:
        call.cancel()
