"""The SGLang engine, created inside the training process (`sglang.Engine`, SGLang 0.5.17).

sglang is imported only when an engine is built: CPU installs never need it, and importing
`sglang.srt.entrypoints.engine` has process-wide side effects (uvloop event-loop policy; at Engine start
`mp.set_start_method("spawn", force=True)` and a SIGQUIT handler; engine.py:1639-1670).

Facts this adapter relies on are in docs/sglang-layout.md (file:line in SGLang's source). In short:
- token ids in and out (`skip_tokenizer_init=True`); requests run concurrently as one task each on
  `engine.loop`, every one with its own `sampling_seed` (only used with deterministic inference, where a
  missing seed means 42 for all: sampling_batch_info.py:118-132);
- weights go per TP rank: `UpdateWeightsFromTensorReqInput.serialized_named_tensors[r]` is deserialized only
  by rank r (tp_worker.py:198-212); `Engine.update_weights_from_tensor` would send one list to every rank;
- the weight version travels on that request (`weight_version`, a str in SGLang) and comes back in every
  output's meta_info; `finish_weight_update` sends it with a FINISH marker that runs the post-load hook;
- a failing scheduler SIGQUITs this process and SGLang's handler SIGKILLs the whole process tree. The adapter
  replaces that handler so an engine death becomes an EngineError, and the loader never raises (it reports
  through files in a status directory, sglang_loader.py);
- `engine.loop` runs forever in a thread of its own ("mtrain-sglang-loop"): requests are submitted to it one by
  one from any thread or event loop (`submit`), and weight/memory calls from the trainer's thread are run on it
  and waited for (`_run`). SGLang's tokenizer manager binds to whichever loop first runs it
  (utils/common.py:4529), so it is armed from that thread. Off the main thread SGLang installs no signal
  handler; ours (installed from the main thread after start) marks the engine dead.
Other process-wide effects of an in-process engine and how the trainer guards against each: docs/design-pool.md.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import uuid
import weakref
from typing import Any, Awaitable, Mapping, Sequence

import torch

from mtrain.rollout.engine_env import engine_environment
from mtrain.rollout.lora_adapters import AdapterVersions
from mtrain.rollout.protocol import (
    MEMORY_TAGS,
    Completion,
    EngineError,
    Request,
    RolloutEngine,
    emit_tokens,
)
from mtrain.rollout.sglang_stream import StreamAssembler
from mtrain.rollout.vision_requests import check_vision_request
from mtrain.rollout.sglang_preflight import preflight_problems, sgl_kernel_extensions, unknown_server_args
from mtrain.rollout.sglang_loader import (
    DUMP_PARAMS,
    DUMP_PREFIX,
    FINISH_NAME,
    LOAD_DIRECT,
    STATUS_DIR_ENV,
    collect_errors,
)
from mtrain.rollout.sglang_wire import (  # noqa: F401 - re-exported: the engine's public helpers
    _marker_tensor,
    sglang_image_data,
    completion_from_output,
    engine_server_args,
    routing_request_args,
    serialize_bucket,
    to_sglang_sampling,
)

logger = logging.getLogger(__name__)

SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
NON_STREAM_INTERVAL = 50  # SGLANG_FORCE_STREAM_INTERVAL: how often a non-streamed request's tokens reach the TM
class SGLangEngine(RolloutEngine):
    """`sglang.Engine` in this process. One per process: it owns the process's SIGQUIT handler."""

    layout = "sglang"

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        mem_fraction_static: float = 0.5,
        base_gpu_id: int = 0,
        load_format: str = "auto",
        random_seed: int = 0,
        deterministic: bool = False,
        server_args: Mapping[str, Any] | None = None,
        routing=None,
    ) -> None:
        """routing: a `mtrain.rollout.routing.RoutingShape` to return every request's routed experts (routing
        replay): the server starts with `enable_return_routed_experts` and each request asks for them."""
        try:
            import sglang
            from sglang.srt.managers import io_struct
            from sglang.srt.managers.tokenizer_manager import RequestAbortedError
        except Exception as e:  # ImportError, or a broken install failing at import
            raise EngineError(f"SGLangEngine needs sglang 0.5.17 (GPU bundle, benchmarks/gpu_setup.sh); "
                              f"importing it failed: {type(e).__name__}: {e}") from e
        self._io = io_struct
        self._aborted_error = RequestAbortedError
        self.tp_size = int(tp_size)
        self._weight_version = 0
        self._released: set[str] = set()
        self._pull = None  # pull_protocol.PullSender: what the engine ranks hold of pull mode's sources and tables
        self._inflight: dict[str, Request] = {}
        self._aborted: set[str] = set()  # SGLang rids aborted before they reached the scheduler
        self._tasks: set[concurrent.futures.Future] = set()  # everything submitted to engine.loop, for death
        self._gate: asyncio.Event | None = None  # closed by pause(): requests wait before reaching SGLang
        self._in_place: int | None = None  # pause_in_place: the weight version the engines paused at
        self._boundaries: dict[str, list[tuple[int, int]]] = {}  # srid -> (tokens so far, their version) per update
        self._aborts = 0
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._engine = None
        self._seeds = random.Random(random_seed)
        self._image_token_id, self._model_type = _vision_of(model_path)  # (None, type) for a text model
        self._routing = routing
        # model.lora (enable_lora in server_args): requests name the active versioned adapter (lora_adapters.py)
        self._lora = bool((server_args or {}).get("enable_lora"))
        self.adapters = AdapterVersions()
        self._status_dir = tempfile.mkdtemp(prefix="mtrain-sglang-status-")
        kwargs = engine_server_args(model_path, tp_size=self.tp_size, mem_fraction_static=mem_fraction_static,
                                    base_gpu_id=base_gpu_id, load_format=load_format, random_seed=random_seed,
                                    deterministic=deterministic, extra=server_args, routed_experts=routing is not None)
        # Refuse, before a 40-110 s start, what would kill the schedulers at the first request (sglang_preflight.py).
        problems = unknown_server_args(server_args or {}, _server_arg_names()) + preflight_problems(
            kwargs, _config_of(model_path), sgl_kernel_extensions())
        if problems:
            shutil.rmtree(self._status_dir, ignore_errors=True)
            raise EngineError(f"SGLang engine for {model_path!r} not started: " + "; ".join(problems))
        # A further node's part of an engine spanning nodes (node_rank > 0): its schedulers serve that node's TP ranks
        # and take every request and weight call from node 0's part by SGLang's own broadcast; this object only
        # holds them. SGLang would block in the constructor unless told not to (engine.py:1105-1132).
        self.node_part = int(kwargs.get("node_rank", 0) or 0) > 0
        children_before = _child_pids()
        logging_before = logging_state()
        env = {STATUS_DIR_ENV: self._status_dir}
        if self.node_part:
            env["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
        with engine_environment(extra=env):
            try:
                self._engine = sglang.Engine(**kwargs)
            except BaseException as e:
                _kill_new_children(children_before)  # a failed start leaves scheduler processes behind
                shutil.rmtree(self._status_dir, ignore_errors=True)
                raise EngineError(f"sglang.Engine failed to start for {model_path!r} (tp_size={tp_size}): "
                                  f"{type(e).__name__}: {e}") from e
        restore_logging(logging_before)  # SGLang's configure_logger resets the root logger (force=True)
        if self.node_part:
            self._dead = "this is a further node's part of an engine: node 0's part takes every call"
            return
        loop = self._engine.loop
        self._thread = threading.Thread(target=loop.run_forever, name="mtrain-sglang-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._arm(), loop).result()
        _LIVE.add(self)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, _on_sigquit)

    async def _arm(self) -> None:
        """Start SGLang's output loop on engine.loop (from its thread: auto_create_handle_loop attaches to the
        *running* loop, utils/common.py:4529) and open the gate that `pause` closes."""
        self._engine.tokenizer_manager.auto_create_handle_loop()
        self._gate = asyncio.Event()
        self._gate.set()

    def _on_engine_death(self) -> None:
        self._dead = ("an SGLang scheduler or detokenizer process died (SIGQUIT); its traceback is in the log "
                      "above. The engine is unusable: shutdown() and start a new one")
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would keep re-sending SIGQUIT
        loop = self._engine.loop
        for task in list(self._tasks):
            loop.call_soon_threadsafe(task.cancel)

    # -- plumbing ---------------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable, what: str) -> concurrent.futures.Future:
        """Schedule `coro` on engine.loop (its own thread); the future is cancelled if the engine dies."""
        if self._dead is not None or self._engine is None:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise EngineError(f"SGLangEngine.{what}: {self._dead or 'the engine was shut down'}")
        if threading.current_thread() is self._thread:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise EngineError(f"SGLangEngine.{what} called from engine.loop's own thread: it would wait on itself; "
                              "await `submit` from a coroutine instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self._engine.loop)
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)
        return fut

    def _run(self, coro: Awaitable, what: str) -> Any:
        """Run `coro` on engine.loop and wait for it (weight, memory and batch calls from the trainer)."""
        fut = self._spawn(coro, what)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise EngineError(f"SGLangEngine.{what}: {self._dead or 'cancelled'}") from None
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"SGLangEngine.{what} failed: {type(e).__name__}: {e}") from e

    def _check_loader_errors(self, what: str) -> None:
        errors = collect_errors(self._status_dir)
        if errors:
            # Each reporting rank validated the whole bucket before writing: it wrote none of it. Other ranks
            # (TP > 1) may have written theirs, so the sync as a whole must be redone.
            raise EngineError(f"SGLangEngine.{what}: the engine rejected the bucket (a reporting rank writes none "
                              "of it; redo the whole sync): " + " | ".join(errors))

    # -- generation -------------------------------------------------------------------------------------
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
        try:
            if req.on_tokens is None:
                return await self._engine.async_generate(**kwargs)
            # Streaming (Request.on_tokens): SGLang's cumulative chunks as deltas; the output is the same dict a
            # non-streamed call returns (sglang_stream.py says which SGLang facts this rests on).
            chunks = await self._engine.async_generate(**kwargs, stream=True)  # an async generator (ENG:535-536)
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
        if out is None:
            self._aborts += 1
            return Completion(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=[], logprobs=[],
                              finish_reason="abort", weight_version=self._weight_version, vision=req.vision)
        c = completion_from_output(req, out, self._weight_version, routing=self._routing)
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

    # -- weights ----------------------------------------------------------------------------------------
    def update_weights(self, rank_tensors: list[list[tuple[str, torch.Tensor]]]) -> None:
        if len(rank_tensors) != self.tp_size:
            raise EngineError(f"update_weights: got tensors for {len(rank_tensors)} ranks, engine tp_size is "
                              f"{self.tp_size}")
        self.update_weights_serialized([serialize_bucket(list(t)) for t in rank_tensors])

    def update_weights_serialized(self, payloads: list[bytes]) -> None:
        """One bucket, already serialized per engine rank (serialize_bucket in each tensor-owning process)."""
        self._send_weights(payloads, LOAD_DIRECT, flush_cache=False, weight_version=None, what="update_weights")

    def finish_weight_update(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise EngineError(f"finish_weight_update: version must be an int >= 0, got {version!r}")
        marker = serialize_bucket([(FINISH_NAME, _marker_tensor())])
        # flush_cache: KV computed with the old weights must not be reused. SGLang asserts that the flush
        # succeeds (scheduler weight_updater.py:103-108), i.e. no request may be running: syncs happen idle.
        self._send_weights([marker] * self.tp_size, LOAD_DIRECT, flush_cache=self._in_place is None,
                           weight_version=str(version),
                           what="finish_weight_update")
        self._weight_version = version

    def pull_weights(self, jobs: Sequence[Any], version: int | None = None) -> None:
        """One bucket in pull mode (`mtrain.reshard.pull`): every engine rank writes its parameters itself from
        the trainer's tensors (CUDA IPC, read in place). jobs[r] is rank r's PullJob, or None when the bucket
        has nothing for it. With `version` this call also ends the sync, as finish_weight_update does."""
        from mtrain.reshard.pull_protocol import PullSender

        if len(jobs) != self.tp_size:
            raise EngineError(f"pull_weights: got jobs for {len(jobs)} ranks, engine tp_size is {self.tp_size}")
        finish = version is not None
        if finish and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise EngineError(f"pull_weights: version must be an int >= 0, got {version!r}")
        if self._pull is None:
            self._pull = PullSender(self.tp_size)
        idle = [(FINISH_NAME, _marker_tensor())] if finish else []
        payloads = [serialize_bucket(idle if job is None else self._pull.payload(r, job, finish, _marker_tensor()))
                    for r, job in enumerate(jobs)]
        try:
            self._send_weights(payloads, LOAD_DIRECT, flush_cache=finish and self._in_place is None,
                               weight_version=str(version) if finish else None, what="pull_weights")
        except EngineError:
            self._pull.forget()
            raise
        for r, job in enumerate(jobs):
            if job is not None:
                self._pull.confirm(r, job)
        if finish:
            self._weight_version = version

    def load_lora_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """SGLang's load_lora_adapter_from_tensors: `tensors` by PEFT/HF names at full shapes (every engine rank
        takes the same copy and slices it itself, lora/layers.py slice_lora_[ab]_weights), `config` PEFT's
        adapter_config. The adapter is registered under `name`; requests that name it load it into a pool slot."""
        if not self._lora:
            raise EngineError("load_lora_adapter: the engine was started without enable_lora")
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # devices by UUID, as serialize_bucket sends them
        # a dict per rank (tp_worker.load_lora_adapter_from_tensors), PEFT's file names (base_model.model. prefix)
        named = {f"base_model.model.{k}": v for k, v in tensors.items()}
        payloads = [MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)]
        obj = self._io.LoadLoRAAdapterFromTensorsReqInput(lora_name=name, config_dict=dict(config),
                                                         serialized_named_tensors=payloads)
        out = self._run(self._engine.tokenizer_manager.load_lora_adapter_from_tensors(obj, None), "load_lora_adapter")
        if not getattr(out, "success", False):
            raise EngineError(f"SGLangEngine.load_lora_adapter({name!r}): SGLang reported failure: "
                              f"{getattr(out, 'error_message', out)}")

    def unload_lora_adapter(self, name: str) -> None:
        obj = self._io.UnloadLoRAAdapterReqInput(lora_name=name)
        out = self._run(self._engine.tokenizer_manager.unload_lora_adapter(obj, None), "unload_lora_adapter")
        if not getattr(out, "success", False):
            raise EngineError(f"SGLangEngine.unload_lora_adapter({name!r}): SGLang reported failure: "
                              f"{getattr(out, 'error_message', out)}")

    def update_weights_hf_names(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """SGLang's own HF-names path, as `Engine.update_weights_from_tensor` runs it (the same list serialized for
        every rank, SGLang's loader fuses and slices): the baseline peers use. Runs on engine.loop's thread."""
        payload = serialize_bucket(list(named_tensors))
        obj = self._io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * self.tp_size,
                                                       load_format=None, flush_cache=False)
        ok, message = self._run(self._engine.tokenizer_manager.update_weights_from_tensor(obj, None),
                                "update_weights_hf_names")
        if not ok:
            raise EngineError(f"SGLangEngine.update_weights_hf_names: SGLang reported failure: {message}")

    def pull_weights_serialized(self, payloads: list[bytes], version: int | None = None) -> None:
        """One bucket in pull mode with owners spread over the engine's GPUs: payloads[r] is engine rank r's request,
        serialized by the training rank on its GPU (`WeightSync._pull_spread`), which also tracks what that rank
        holds. With `version` this call also ends the sync."""
        finish = version is not None
        if finish and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise EngineError(f"pull_weights_serialized: version must be an int >= 0, got {version!r}")
        self._send_weights(list(payloads), LOAD_DIRECT, flush_cache=finish and self._in_place is None,
                           weight_version=str(version) if finish else None, what="pull_weights")
        if finish:
            self._weight_version = version

    def _send_weights(self, payloads: list[bytes], load_format: str, *, flush_cache: bool,
                      weight_version: str | None, what: str) -> None:
        if len(payloads) != self.tp_size:
            raise EngineError(f"{what}: got {len(payloads)} payloads, engine tp_size is {self.tp_size}")
        if "weights" in self._released:
            raise EngineError(f"{what}: weights are released; resume_memory(('weights',)) first")
        obj = self._io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=list(payloads),
                                                       load_format=load_format, flush_cache=flush_cache,
                                                       weight_version=weight_version)
        ok, message = self._run(self._engine.tokenizer_manager.update_weights_from_tensor(obj, None), what)
        self._check_loader_errors(what)
        if not ok:
            raise EngineError(f"SGLangEngine.{what}: SGLang reported failure: {message}")

    def _send_control(self, spec: str, load_format: str, what: str) -> None:
        """One control entry (a name carrying `spec`, an empty tensor) to every engine rank's loader `load_format`;
        no cache flush, no version change."""
        marker = serialize_bucket([(spec, _marker_tensor())])
        self._send_weights([marker] * self.tp_size, load_format, flush_cache=False, weight_version=None, what=what)

    def dump_params(self, out_dir: str, names: Sequence[str] | None = None, what: str = "sha256") -> list[str]:
        """Each engine rank writes `names` (all when None) to out_dir/rank<r>.json (sha256, shape, dtype per
        parameter) or .pt (CPU tensors). Returns the paths, rank order."""
        spec = DUMP_PREFIX + json.dumps({"dir": os.path.abspath(out_dir), "names": None if names is None
                                         else list(names), "what": what})
        self._send_control(spec, DUMP_PARAMS, "dump_params")
        ext = "json" if what == "sha256" else "pt"
        return [os.path.join(os.path.abspath(out_dir), f"rank{r}.{ext}") for r in range(self.tp_size)]

    def probe_activations(self, token_ids: list[int]) -> dict[str, Any]:
        """One prefill of `token_ids` with taps in the scheduler (mtrain/rollout/sglang_taps.py):
        {"taps": {point: [tokens, hidden] float32}, "logprobs": float32 [len - 1], SGLang's own input-token
        logprobs at temperature 1}. The cache is flushed first so every position is computed; the sequence
        must fit one prefill chunk (chunked_prefill_size) for the taps to hold all of it."""
        from mtrain.rollout.sglang_taps import TAP_ACTIVATIONS, tap_spec

        self.flush_cache()
        out_dir = tempfile.mkdtemp(prefix="mtrain-taps-")
        try:
            self._send_control(tap_spec("arm"), TAP_ACTIVATIONS, "probe_activations")
            out = self._run(self._engine.async_generate(
                input_ids=list(token_ids), sampling_params={"max_new_tokens": 1, "temperature": 1.0},
                return_logprob=True, logprob_start_len=0, rid=uuid.uuid4().hex), "probe_activations")
            self._send_control(tap_spec("dump", out_dir), TAP_ACTIVATIONS, "probe_activations")
            taps = torch.load(os.path.join(out_dir, "rank0.pt"))
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        entries = out["meta_info"]["input_token_logprobs"][1:]  # the first position has no logprob
        return {"taps": taps, "logprobs": torch.tensor([e[0] for e in entries], dtype=torch.float32)}

    def weight_checksums(self) -> list[dict]:
        """SGLang's own per-parameter checksums, one dict per TP rank (CheckWeightsReqInput, 0.5.17)."""
        obj = self._io.CheckWeightsReqInput(action="checksum")
        ok, message, ranks, _ = self._run(self._engine.tokenizer_manager.check_weights(obj, None),
                                          "weight_checksums")
        if not ok:
            raise EngineError(f"SGLangEngine.weight_checksums: {message}")
        return ranks or []

    def randomize_weights(self) -> None:
        """Overwrite every parameter with random values (SGLang's check_weights "reset_tensors"): tests use it
        so that a later sync provably writes everything it should."""
        obj = self._io.CheckWeightsReqInput(action="reset_tensors")
        ok, message, _, _ = self._run(self._engine.tokenizer_manager.check_weights(obj, None), "randomize_weights")
        if not ok:
            raise EngineError(f"SGLangEngine.randomize_weights: {message}")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """SGLang's get_weights_by_name: first `truncate_size` rows as float32 lists, from TP rank 0.
        Implemented by the Llama model class only among ours; None when the model lacks it or the name."""
        obj = self._io.GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return self._run(self._engine.tokenizer_manager.get_weights_by_name(obj, None), "get_weights_by_name")

    # -- memory and cache -------------------------------------------------------------------------------
    def _tags(self, tags: Sequence[str], what: str) -> list[str]:
        tags = list(tags)
        bad = [t for t in tags if t not in SGLANG_MEMORY_TAGS]
        if bad or not tags:
            raise EngineError(f"{what}: tags must be a non-empty subset of {SGLANG_MEMORY_TAGS}, got {tags}")
        return tags

    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = self._tags(tags, "release_memory")
        again = [t for t in tags if t in self._released]
        if again:
            raise EngineError(f"release_memory: {again} already released")
        if self._inflight:
            # The scheduler asserts it is idle (scheduler weight_updater.py:203-205); an assert there kills us.
            raise EngineError(f"release_memory: {len(self._inflight)} requests still running")
        self._run(self._engine.tokenizer_manager.release_memory_occupation(
            self._io.ReleaseMemoryOccupationReqInput(tags=tags), None), "release_memory")
        self._released.update(tags)

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        tags = self._tags(tags, "resume_memory")
        missing = [t for t in tags if t not in self._released]
        if missing:
            # Resuming a tag that is not released raises KeyError in the scheduler (weight_updater.py:254-255).
            raise EngineError(f"resume_memory: {missing} not released")
        self._run(self._engine.tokenizer_manager.resume_memory_occupation(
            self._io.ResumeMemoryOccupationReqInput(tags=tags), None), "resume_memory")
        self._released.difference_update(tags)

    def flush_cache(self) -> None:
        out = self._run(self._engine.tokenizer_manager.flush_cache(), "flush_cache")
        if not getattr(out, "success", False):
            raise EngineError(f"flush_cache: SGLang refused (requests running?): {getattr(out, 'message', out)}")

    def shutdown(self) -> None:
        """Stop the engine. Note: SGLang's shutdown kills EVERY child process of this process
        (engine.py:1230, kill_process_tree(os.getpid(), include_parent=False)), not only its own."""
        if self._engine is not None and self.node_part:
            try:
                self._engine.shutdown()
            finally:
                self._engine = None
                shutil.rmtree(self._status_dir, ignore_errors=True)
            return
        if self._engine is not None:
            loop = self._engine.loop
            try:
                self._engine.shutdown()
            finally:
                self._engine = None
                self._dead = self._dead or "the engine was shut down"
                _LIVE.discard(self)
                for task in list(self._tasks):
                    task.cancel()
                loop.call_soon_threadsafe(loop.stop)
                if self._thread is not None:
                    self._thread.join(timeout=10)
                shutil.rmtree(self._status_dir, ignore_errors=True)


_LIVE: "weakref.WeakSet[SGLangEngine]" = weakref.WeakSet()


def versions_from_marks(marks: Sequence[tuple[int, int]], n: int, final: int) -> list[int]:
    """Per-token versions of an n-token output from the updates in place that fell inside it: marks[i] = (tokens the
    request had at update i, capped at n; the version they came from), in update order; the rest are `final`."""
    versions: list[int] = []
    for upto, version in marks:
        upto = min(upto, n)
        versions += [version] * max(0, upto - len(versions))
    return versions + [final] * (n - len(versions))


def _server_arg_names() -> list[str]:
    """The argument names sglang.Engine takes (its ServerArgs dataclass's fields)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs
    return [f.name for f in dataclasses.fields(ServerArgs)]


def _config_of(model_path: str) -> dict | None:
    """The model folder's config.json, or None when it cannot be read (SGLang then reports it at start)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _vision_of(model_path: str) -> tuple[int | None, str]:
    """(image_token_id or None, model_type) from the model folder's config.json (a VLM declares vision_config)."""
    cfg = _config_of(model_path)
    if cfg is None:
        return None, "unknown"
    vlm = isinstance(cfg.get("vision_config"), dict) and cfg.get("image_token_id") is not None
    return (int(cfg["image_token_id"]) if vlm else None), str(cfg.get("model_type", "unknown"))


def _on_sigquit(signum: int, frame: Any) -> None:
    """A scheduler or detokenizer of some engine in this process died (SGLang signals its parent). We cannot
    tell which engine: every live one is marked dead, and its waiting calls fail with EngineError."""
    logger.error("SGLang: a child process died (SIGQUIT)")
    for engine in list(_LIVE):
        engine._on_engine_death()


def logging_state() -> tuple:
    root = logging.getLogger()
    return root.level, list(root.handlers)


def restore_logging(state: tuple) -> None:
    """Undo SGLang's `logging.basicConfig(force=True, level=...)` on the trainer's root logger."""
    root = logging.getLogger()
    level, handlers = state
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new_children(before: set[int]) -> None:
    """Kill the processes a failed engine start left behind, by pid; other children are not touched."""
    import psutil

    for pid in sorted(_child_pids() - before):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
