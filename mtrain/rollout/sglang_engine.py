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

The engine is split by responsibility: requests (sglang_engine_requests.py), weights
(sglang_engine_weights.py), control calls, memory and cache (sglang_engine_control.py) and the process-wide side
(sglang_engine_process.py); this file holds the engine's state, its start, the loop plumbing and shutdown.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import random
import shutil
import signal
import tempfile
import threading
from typing import Any, Awaitable, Mapping

from mtrain.rollout.engine_env import engine_environment
from mtrain.rollout.lora_adapters import AdapterVersions
from mtrain.rollout.protocol import EngineError, Request, RolloutEngine
from mtrain.rollout.sglang_engine_control import SGLANG_MEMORY_TAGS, SGLangControl  # noqa: F401 - re-exported
from mtrain.rollout.sglang_engine_process import (_LIVE, _child_pids, _config_of, _kill_new_children,  # noqa: F401
                                                  _on_sigquit, _server_arg_names, _vision_of, logging_state,
                                                  restore_logging)
from mtrain.rollout.sglang_engine_requests import NON_STREAM_INTERVAL, SGLangRequests, versions_from_marks  # noqa: F401
from mtrain.rollout.sglang_engine_weights import SGLangWeights
from mtrain.rollout.sglang_preflight import preflight_problems, sgl_kernel_extensions, unknown_server_args
from mtrain.rollout.sglang_loader import STATUS_DIR_ENV, collect_errors
from mtrain.rollout.sglang_wire import (  # noqa: F401 - re-exported: the engine's public helpers
    BITWISE_MODEL_PACKAGE,
    _marker_tensor,
    bitwise_architecture,
    sglang_image_data,
    completion_from_output,
    engine_server_args,
    routing_request_args,
    serialize_bucket,
    to_sglang_sampling,
)

class SGLangEngine(SGLangRequests, SGLangWeights, SGLangControl, RolloutEngine):
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
        on_policy: str = "off",
    ) -> None:
        """routing: a `mtrain.rollout.routing.RoutingShape` to return every request's routed experts (routing
        replay): the server starts with `enable_return_routed_experts` and each request asks for them.
        on_policy: numerics.on_policy; "bitwise" serves the model through mtrain's bitwise classes
        (mtrain/rollout/sglang_models/bitwise.py, docs/design-on-policy.md)."""
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
        self._adapter_of: dict[str, str] = {}  # srid -> the LoRA adapter it was stamped with (lora_adapters.py)
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
        bitwise = on_policy == "bitwise"
        override = bitwise_architecture(((_config_of(model_path) or {}).get("architectures") or ["?"])[0]) \
            if bitwise else None
        kwargs = engine_server_args(model_path, tp_size=self.tp_size, mem_fraction_static=mem_fraction_static,
                                    base_gpu_id=base_gpu_id, load_format=load_format, random_seed=random_seed,
                                    deterministic=deterministic, extra=server_args, routed_experts=routing is not None,
                                    architecture_override=override)
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
        if bitwise:  # the schedulers register mtrain's model classes at import (sglang/srt/models/registry.py)
            env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = BITWISE_MODEL_PACKAGE
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
