"""Request-by-request submission over an engine whose native call is a batch: `generate(list)`.

The CPU reference engine decodes a list of requests together. `Batcher` gives it the per-request contract the
pool needs (`submit(request) -> Future`, `abort`, `pause`/`resume`): a worker thread takes whatever requests are
queued when it becomes free (after a short pause so that a burst of submissions lands in one batch) and runs
them as one `generate` call. Throughput on CPU therefore stays that of batched decoding while callers issue,
await and abort requests one by one. Results do not depend on batching: every request samples from its own
seeded generator (see reference_engine.py).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable

from mtrain.rollout.protocol import Completion, EngineError, Request


class Batcher:
    def __init__(self, run_batch: Callable[[list[Request]], list[Completion]], *, name: str,
                 max_batch: int = 256, coalesce_s: float = 0.005):
        self._run_batch = run_batch
        self._max_batch, self._coalesce_s = max_batch, coalesce_s
        self._queue: list[tuple[Request, concurrent.futures.Future]] = []
        self._cv = threading.Condition()
        self._paused = False
        self._closed: str | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed is not None:
                fut.set_exception(EngineError(f"submit {request.rid!r}: {self._closed}"))
                return fut
            self._queue.append((request, fut))
            self._cv.notify()
        return fut

    def abort_queued(self, rid_prefix: str | None) -> int:
        """Queued (not yet running) requests matching the prefix finish now with no tokens, "abort"; returns how
        many did."""
        with self._cv:
            keep, gone = [], []
            for req, fut in self._queue:
                (gone if rid_prefix is None or req.rid.startswith(rid_prefix) else keep).append((req, fut))
            self._queue = keep
        count = 0
        for req, fut in gone:
            if fut.cancelled():
                continue
            fut.set_result(Completion(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=[], logprobs=[],
                                      finish_reason="abort", weight_version=-1, vision=req.vision))
            count += 1
        return count

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def close(self, reason: str) -> None:
        with self._cv:
            self._closed = reason
            pending, self._queue = self._queue, []
            self._cv.notify()
        for req, fut in pending:
            if not fut.cancelled():
                fut.set_exception(EngineError(f"request {req.rid!r}: {reason}"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._closed is None and (self._paused or not self._queue):
                    self._cv.wait()
                if self._closed is not None:
                    return
            time.sleep(self._coalesce_s)  # let the rest of a burst of submissions arrive
            with self._cv:
                if self._paused or self._closed is not None:
                    continue
                batch, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
            if not batch:
                continue
            # A caller that gave up (asyncio timeout -> wrap_future cancels) must not take the worker down with it:
            # its request is dropped if not started, and its result discarded if it was.
            batch = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                outs = self._run_batch([r for r, _ in batch])
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets the engine's error
                for _, fut in batch:
                    fut.set_exception(e if isinstance(e, Exception) else EngineError(str(e)))
                continue
            for (_, fut), out in zip(batch, outs):
                fut.set_result(out)
