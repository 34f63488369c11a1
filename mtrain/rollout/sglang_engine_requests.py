"""Requests of the in-process SGLang engine: generate / submit on engine.loop, the pause gate, aborts, and the
per-token weight versions an update in place leaves (a mixin of SGLangEngine, sglang_engine.py, which owns the
state and the loop plumbing it uses)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Any, Sequence

from mtrain.rollout.lora_adapters import version_of
from mtrain.rollout.protocol import Completion, EngineError, Request, emit_tokens
from mtrain.rollout.sglang_stream import StreamAssembler
from mtrain.rollout.sglang_wire import completion_from_output, routing_request_args, sglang_image_data, to_sglang_sampling
from mtrain.rollout.vision_requests import check_vision_request

NON_STREAM_INTERVAL = 50  # SGLANG_FORCE_STREAM_INTERVAL: how often a non-streamed request's tokens reach the TM


class SGLangRequests:
    """generate / submit / abort, pause / resume (before SGLang), pause_in_place / continue_generation."""

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def generate(self, requests: list[Request]) -> list[Completion]:
        if not requests:
            return []
        for r in requests:
            if not r.prompt_ids or not all(isinstance(t, int) and t >= 0 for t in r.prompt_ids):
                raise EngineError(f"request {r.rid!r}: prompt_ids must be a non-empty list of token ids")
            routing_request_args(r, self._routing)  # a bad routed_experts_start: refused before SGLang sees any
        # Our own fixed-length rids: SGLang's scheduler aborts by prefix, so "a1" would also abort "a10".
        srids = [uuid.uuid4().hex for _ in requests]
        self._inflight.update(zip(srids, requests))
        try:
            outs = self._run(self._generate_all(requests, srids), "generate")
        finally:
            for s in srids:
                self._inflight.pop(s, None)
        errors = [f"{r.rid!r}: {type(o).__name__}: {o}" for r, o in zip(requests, outs) if isinstance(o, Exception)]
        if errors:
            raise EngineError(f"SGLang failed {len(errors)} of {len(requests)} requests: " + "; ".join(errors[:5]))
        return [self._completion(r, o, s) for r, o, s in zip(requests, outs, srids)]

    async def _generate_all(self, requests: list[Request], srids: list[str]) -> list[Any]:
        return await asyncio.gather(*(self._one(r, s) for r, s in zip(requests, srids)), return_exceptions=True)

    async def _one(self, req: Request, srid: str) -> Any:
        await self._gate.wait()  # pause() holds requests here, before SGLang sees them
        if srid in self._aborted:
            return None
        seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(62)
        check_vision_request(req, self._image_token_id, self._model_type)  # as the reference engine refuses
        images = sglang_image_data(req)  # None for text; one "processor_output" item for all of a prompt's images
        kwargs = dict(input_ids=list(req.prompt_ids), sampling_params=to_sglang_sampling(req.params, seed),
                      return_logprob=True, rid=srid, top_logprobs_num=req.params.top_logprobs,
                      **({"image_data": images} if images is not None else {}),
                      **routing_request_args(req, self._routing))
        assembler = None
        # Stamped here, on engine.loop with no await before SGLang registers the request: an unload of the previous
        # adapter (switch_adapter) waits for this request's release below.
        adapter = self.adapters.acquire() if self._lora else None
        if adapter is not None:
            kwargs["lora_path"] = adapter
            self._adapter_of[srid] = adapter
        try:
            if req.on_tokens is None:
                return await self._versioned_generate(kwargs, stream=False)
            # Streaming (Request.on_tokens): SGLang's cumulative chunks as deltas; the output is the same dict a
            # non-streamed call returns (sglang_stream.py says which SGLang facts this rests on).
            chunks = await self._versioned_generate(kwargs, stream=True)  # an async generator
            assembler = StreamAssembler(req)
            async for chunk in chunks:
                delta = assembler.feed(chunk)
                if delta is not None:
                    emit_tokens(req, delta)
            return assembler.output()
        except self._aborted_error:
            # aborted before it reached the scheduler: no tokens (or, streamed, the ones already passed on)
            return assembler.output(aborted=True) if assembler is not None else None
        finally:
            self.adapters.release(adapter)

    async def _versioned_generate(self, kwargs: dict, stream: bool) -> Any:
        """Engine.async_generate (ENG:444-538) with the radix-cache key namespaced by the weight version the request
        starts on. An update in place finishes with flush_cache=False (the flush needs an idle scheduler), so the
        prefix cache still holds KV the old weights computed; without the namespace a request started after the
        update reuses that KV while its tokens are recorded as the new version. SGLang keys its radix tree by
        (extra_key, token ids) (radix_cache.py RadixKey; io_struct.py GenerateReqInput.extra_key; a LoRA id is
        appended to it, schedule_batch.py Req.__init__), so prefixes are shared within a version and never across
        versions. Engine.async_generate does not pass extra_key on, hence the request object built here."""
        obj = self._io.GenerateReqInput(**kwargs, stream=stream, extra_key=f"mtrain-weights-v{self._weight_version}")
        generator = self._engine.tokenizer_manager.generate_request(obj, None)
        return generator if stream else await generator.__anext__()

    def submit(self, request: Request) -> concurrent.futures.Future:
        """One request onto engine.loop, where SGLang batches it with every other running request."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        if not request.prompt_ids or not all(isinstance(t, int) and t >= 0 for t in request.prompt_ids):
            out.set_exception(EngineError(f"request {request.rid!r}: prompt_ids must be a non-empty list of "
                                          "token ids"))
            return out
        try:
            routing_request_args(request, self._routing)  # a bad routed_experts_start fails this request only
        except EngineError as e:
            out.set_exception(e)
            return out
        srid = uuid.uuid4().hex
        self._inflight[srid] = request
        try:
            fut = self._spawn(self._one(request, srid), "submit")
        except EngineError as e:
            self._inflight.pop(srid, None)
            out.set_exception(e)
            return out

        def done(f: concurrent.futures.Future) -> None:
            self._inflight.pop(srid, None)
            self._aborted.discard(srid)
            try:
                out.set_result(self._completion(request, f.result(), srid))
            except concurrent.futures.CancelledError:
                out.set_exception(EngineError(f"request {request.rid!r}: {self._dead or 'cancelled'}"))
            except Exception as e:  # noqa: BLE001 - delivered to the caller
                out.set_exception(e if isinstance(e, EngineError) else EngineError(f"request {request.rid!r}: "
                                                                                   f"{type(e).__name__}: {e}"))

        fut.add_done_callback(done)
        return out

    def pause(self) -> None:
        self._spawn(self._set_gate(False), "pause").result()

    def resume(self) -> None:
        self._spawn(self._set_gate(True), "resume").result()

    async def _set_gate(self, open_: bool) -> None:
        (self._gate.set if open_ else self._gate.clear)()

    def _completion(self, req: Request, out: Any, srid: str | None = None) -> Completion:
        marks = self._boundaries.pop(srid, None) if srid is not None else None
        # LoRA: SGLang keeps a request on the adapter it named for its whole life, through updates in place, so
        # every token carries that adapter's version (the base never changes after the first sync)
        adapter = self._adapter_of.pop(srid, None) if srid is not None else None
        version = self._weight_version if adapter is None else version_of(adapter)
        if adapter is not None:
            marks = None
        if out is None:
            self._aborts += 1
            return Completion(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=[], logprobs=[],
                              finish_reason="abort", weight_version=version, vision=req.vision)
        c = completion_from_output(req, out, version, routing=self._routing)
        self._aborts += c.finish_reason == "abort"
        if marks:  # an update in place fell inside this request: its earlier tokens carry the older versions
            c.token_versions = versions_from_marks(marks, len(c.output_ids), c.weight_version)
        return c

    @property
    def aborted_requests(self) -> int:
        return self._aborts

    def pause_in_place(self) -> None:
        """SGLang's pause_generation(mode="in_place"): the scheduler stops between two batches and keeps every running
        request and its KV (io_struct.py:1601-1621); while paused, update_weights_from_tensor skips the model-update
        lock (tokenizer_control_mixin.py:514-521), and every sync's finish runs with flush_cache=False (the flush needs
        an idle scheduler and would assert, SGLANG-APIS.md section 1)."""
        if self._in_place is not None:
            raise EngineError("pause_in_place: already paused")
        tm = self._engine.tokenizer_manager
        self._run(tm.pause_generation(self._io.PauseGenerationReqInput(mode="in_place")), "pause_in_place")
        self._in_place = self._weight_version

    def continue_generation(self) -> None:
        if self._in_place is None:
            raise EngineError("continue_generation: not paused (pause_in_place first)")
        if self._weight_version != self._in_place:
            self._run(self._mark_versions(self._in_place), "continue_generation")
        tm = self._engine.tokenizer_manager
        self._run(tm.continue_generation(self._io.ContinueGenerationReqInput()), "continue_generation")
        self._in_place = None

    async def _mark_versions(self, old: int) -> None:
        """Before continuing: how many tokens each paused request has, all made by version `old`. Read from the
        tokenizer manager's state after the sync, when the outputs of the last batch before the pause have landed.
        Streamed requests get every token forwarded (exact); a non-streamed one only every
        SGLANG_FORCE_STREAM_INTERVAL (50) tokens (output_streamer.py:385-388), so up to 49 further tokens are
        counted as old: a token's version is never newer than the weights that made it."""
        states = self._engine.tokenizer_manager.rid_to_state
        for srid, req in list(self._inflight.items()):
            state = states.get(srid)
            if state is None:
                continue  # still held by pause() or queued: it starts on the new weights
            held = len(state.output_ids) + (0 if req.on_tokens is not None else NON_STREAM_INTERVAL - 1)
            self._boundaries.setdefault(srid, []).append((held, old))

    def abort(self, rid_prefix: str | None = None) -> None:
        """Abort our in-flight requests whose rid starts with rid_prefix (all when None). Thread-safe: may be
        called from another thread while generate() runs. The tokenizer manager only forwards an abort for an
        rid it knows exactly (tokenizer_manager.py:1930-1968), so each matching rid is aborted by name."""
        if self._dead is not None or self._engine is None:
            return

        def do() -> None:
            for srid, req in list(self._inflight.items()):
                if rid_prefix is None or req.rid.startswith(rid_prefix):
                    self._aborted.add(srid)  # one still held by pause() returns without reaching SGLang
                    self._engine.tokenizer_manager.abort_request(rid=srid)

        self._engine.loop.call_soon_threadsafe(do)


def versions_from_marks(marks: Sequence[tuple[int, int]], n: int, final: int) -> list[int]:
    """Per-token versions of an n-token output from the updates in place that fell inside it: marks[i] = (tokens the
    request had at update i, capped at n; the version they came from), in update order; the rest are `final`."""
    versions: list[int] = []
    for upto, version in marks:
        upto = min(upto, n)
        versions += [version] * max(0, upto - len(versions))
    return versions + [final] * (n - len(versions))

