"""The CPU reference engine: a HF transformers model behind the RolloutEngine protocol.

It exists so CI runs the whole RL loop for real on CPU (DESIGN.md, "Engines"): it really samples (per-request
seeded generators, temperature/top-k/top-p, stop ids), really receives weights through the planner in the HF
*on-disk* layout ("hf"), and really frees/reallocates its weight memory, with the same failure modes as SGLang
(generate on released or half-synced weights is an error, not silent garbage). It is not fast and not a
substitute for SGLang on GPU.

Vision-language configs (a `vision_config` and an `image_token_id`: Qwen2.5-VL) run transformers' image-text class
(Qwen2_5_VLForConditionalGeneration): a request's `vision` (mtrain.data.vision.VisionInputs, computed once by the
processor) gives the pixel values and patch grids of the prefill, and positions are the model's own multimodal
RoPE indices (transformers' get_rope_index), continued through decoding with each row's rope delta.

The engine is split by responsibility: the HF-model helpers (reference_engine_hf.py), sampling
(reference_engine_sampling.py), the decoding loop (reference_engine_decode.py), weights and memory
(reference_engine_weights.py) and LoRA adapter slots (reference_engine_lora.py); this file holds the engine's state,
its life cycle and request handling.
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import threading
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from mtrain.rollout.batcher import Batcher
from mtrain.rollout.lora_adapters import AdapterVersions
from mtrain.rollout.protocol import (Completion, EngineError, Request, RolloutEngine, SamplingParams,
                                     routed_start_error)
from mtrain.rollout.reference_engine_decode import ReferenceDecoding
from mtrain.rollout.reference_engine_hf import as_hf_config, hf_disk_views, peft_plain_name  # noqa: F401 - re-exported
from mtrain.rollout.reference_engine_lora import ReferenceLoraSlots
from mtrain.rollout.reference_engine_sampling import sample_token, top_alternatives  # noqa: F401 - re-exported
from mtrain.rollout.reference_engine_weights import ReferenceWeights
from mtrain.rollout.vision_requests import check_vision_request


class ReferenceEngine(ReferenceWeights, ReferenceLoraSlots, ReferenceDecoding, RolloutEngine):
    """A HF model on CPU generating with a KV cache, one request group per prompt length (no padding).

    Requests of equal prompt length decode together and stay aligned (finished ones are dropped from the
    cache), so no padding or attention mask ever enters the computation: a request's tokens are those of
    a plain uncached loop, whatever it is batched with.
    """

    layout = "hf"
    tp_size = 1

    def __init__(self, config: dict[str, Any] | PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                 init_seed: int = 0, allow_dtype_cast: bool = False, decode_delay_s: float = 0.0,
                 record_routing: bool = False, lora: dict | None = None) -> None:
        """decode_delay_s: sleep this long per decoding step (a test hook: a slow engine in a pool).
        record_routing: return every input token's routed experts (`Completion.routed_experts`, routing replay),
        read from the model's own MoE blocks as they run (`mtrain.rollout.routing_capture`)."""
        self._config = as_hf_config(config)
        self._decode_delay_s = float(decode_delay_s)
        with torch.random.fork_rng(devices=[]):  # random init must not disturb the caller's RNG stream
            torch.manual_seed(init_seed)
            # eager attention and experts: the plainest paths, identical math for any batch composition
            auto = AutoModelForImageTextToText if self._is_vlm(self._config) else AutoModelForCausalLM
            model = auto.from_config(self._config, dtype=dtype, attn_implementation="eager",
                                     experts_implementation="eager")
        self._model = model.eval().requires_grad_(False)
        self._views = hf_disk_views(self._model)  # the base weights only: adapters arrive by name (below)
        # model.lora: adapters held unmerged, as PEFT LoRA layers on the HF model, one PEFT adapter per weight
        # version (mtrain/rollout/lora_adapters.py), loaded and unloaded by name as SGLang's are; the engine's LoRA
        # arithmetic is PEFT's, not the trainer's. lora: PEFT LoraConfig fields (r, lora_alpha, target_modules).
        self._lora = lora
        self._dtype = dtype
        self.adapters = AdapterVersions()
        self._slot_of: dict[str, str] = {}  # loaded adapter name -> its PEFT adapter slot
        self._slot_cache: dict[str, dict] = {}  # every injected slot -> {HF name: its parameter}
        self._allow_dtype_cast = allow_dtype_cast
        storages = {}
        for t in self._model.state_dict(keep_vars=True).values():
            storages.setdefault(t.untyped_storage().data_ptr(), (t, t.untyped_storage().nbytes()))
        self._storages = list(storages.values())  # (tensor owning it, bytes) once per storage
        self._vocab = int(self._model.get_output_embeddings().weight.shape[0])
        self._vlm = self._is_vlm(self._config)
        self._max_positions = getattr(self._config.get_text_config(), "max_position_embeddings", None)
        self._version = 0
        self._stale: set[str] = set()  # names not written since weights were resumed
        self._sync_open = False  # update_weights called, finish_weight_update not yet
        self._written: set[str] = set()  # the weights this open sync wrote (a LoRA run's vision sync writes a few)
        self._pull = None  # (pull_protocol.PullSender, PullState) once pull mode is used
        self._released: set[str] = set()
        self._shut = False
        self._model_lock = threading.Lock()  # one generate / update / release at a time
        self._abort_lock = threading.Lock()
        self._progress: dict[str, int] = {}  # in-flight rid -> tokens generated so far
        self._aborted: set[str] = set()
        self._aborts = 0  # requests ended "abort" (aborted_requests)
        # pause_in_place: generation parks at a gate between decoding steps, giving the model lock to a weight sync
        self._pause_cv = threading.Condition()
        # the adapter the generate call of this thread holds, as (name,); None outside a call (lora_adapters.py)
        self._call = threading.local()
        self._paused_in_place = False
        self._batcher: Batcher | None = None  # started by the first submit()
        self._routing = None
        if record_routing:
            from mtrain.rollout.routing_capture import RoutingRecorder
            self._routing = RoutingRecorder(self._model, self._config.to_dict())

    @staticmethod
    def _is_vlm(config: PretrainedConfig) -> bool:
        return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None

    @classmethod
    def from_pretrained(cls, hf_dir: str, **kwargs: Any) -> "ReferenceEngine":
        """An engine holding the weights of a HF checkpoint folder (config.json + *.safetensors), loaded
        through update_weights so that a checkpoint missing any weight is an error."""
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not files:
            raise EngineError(f"ReferenceEngine.from_pretrained: no *.safetensors in {hf_dir!r}")
        engine = cls(AutoConfig.from_pretrained(hf_dir), **kwargs)
        tied = set(getattr(engine._model, "all_tied_weights_keys", None) or {})
        engine._stale = set(engine._views)
        for path in files:
            with safe_open(path, framework="pt") as f:
                bucket = []
                for name in f.keys():
                    if name in tied:  # some checkpoints store the tied lm_head too
                        continue
                    tensor = f.get_tensor(name)
                    bucket.append((name, tensor.to(engine._views[name].dtype) if name in engine._views else tensor))
            engine.update_weights([bucket])
        engine.finish_weight_update(0)
        return engine

    def shutdown(self) -> None:
        if self._shut:
            return
        if self._batcher is not None:
            self._batcher.close("the engine was shut down")
        self.abort(None)
        with self._pause_cv:  # a generation parked at the gate wakes up and ends with "shut down"
            self._paused_in_place = False
            self._pause_cv.notify_all()
        with self._model_lock:
            self._shut = True
            self._model = None
            self._views = {}
            self._storages = []

    def _check_alive(self, op: str) -> None:
        if self._shut:
            raise EngineError(f"{op}: the engine was shut down")

    # ---------------------------------------------------------------- generation
    def abort(self, rid_prefix: str | None = None) -> None:
        if self._batcher is not None:
            queued = self._batcher.abort_queued(rid_prefix)
            with self._abort_lock:
                self._aborts += queued
        with self._abort_lock:
            self._aborted.update(r for r in self._progress if rid_prefix is None or r.startswith(rid_prefix))

    def submit(self, request: Request) -> concurrent.futures.Future:
        """One request, batched with whatever else is queued when the model is free (`Batcher`)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._check_alive("submit")
            self._check_request(request)
        except EngineError as e:  # refused on its own: other requests are not affected
            fut.set_exception(e)
            return fut
        return self._requests().submit(request)

    def _requests(self) -> Batcher:
        with self._abort_lock:
            if self._batcher is None:
                self._batcher = Batcher(self.generate, name="mtrain-reference-engine")
            return self._batcher

    def pause(self) -> None:
        self._check_alive("pause")
        self._requests().pause()

    def resume(self) -> None:
        self._check_alive("resume")
        if self._batcher is not None:
            self._batcher.resume()

    @property
    def aborted_requests(self) -> int:
        with self._abort_lock:
            return self._aborts

    def pause_in_place(self) -> None:
        """Close the gate between decoding steps and wait until no generation holds the model: a running batch parks
        at the gate with its KV cache (SGLang's in_place pause), a queued one parks before its prefill."""
        self._check_alive("pause_in_place")
        with self._pause_cv:
            if self._paused_in_place:
                raise EngineError("pause_in_place: already paused")
            self._paused_in_place = True
        with self._model_lock:  # held by a decoding loop until it reaches the gate
            pass

    def continue_generation(self) -> None:
        with self._pause_cv:
            if not self._paused_in_place:
                raise EngineError("continue_generation: not paused (pause_in_place first)")
            self._paused_in_place = False
            self._pause_cv.notify_all()

    def _gate(self) -> None:
        """Called with the model lock held, between decoding steps: while paused in place, give the lock up (a weight
        sync takes it), wait for continue_generation, take it back. The weights found then must be complete."""
        with self._pause_cv:
            if not self._paused_in_place:
                return
        self._model_lock.release()
        try:
            with self._pause_cv:
                while self._paused_in_place and not self._shut:
                    self._pause_cv.wait()
        finally:
            self._model_lock.acquire()
        self._check_alive("generate")
        self._check_ready()  # continued before the sync's finish_weight_update: refused, not decoded on half weights
        held = getattr(self._call, "adapter", None)
        if self._lora is not None and held is not None:  # another call may have set the PEFT layers meanwhile
            self._use_adapter(held[0])

    def active_requests(self) -> dict[str, int]:
        """In-flight rid -> tokens generated so far (queued requests show 0)."""
        with self._abort_lock:
            return dict(self._progress)

    def generate(self, requests: list[Request]) -> list[Completion]:
        self._check_alive("generate")
        for req in requests:
            self._check_request(req)
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            dup = sorted({r for r in rids if rids.count(r) > 1})
            raise EngineError(f"generate: duplicate rids {dup[:5]}")
        with self._abort_lock:  # registered before waiting for the model, so queued requests can be aborted
            busy = [r for r in rids if r in self._progress]
            if busy:
                raise EngineError(f"generate: rids already in flight: {busy[:5]}")
            self._progress.update((r, 0) for r in rids)
        try:
            with self._model_lock:
                self._check_alive("generate")  # shutdown may have happened while this call waited
                self._gate()  # a batch taken while paused in place waits before its prefill
                self._check_ready()
                # the adapter this call generates with, held until it returns (a sync that loads another one waits
                # for the model lock, or, paused in place (stream), retires the held one: lora_adapters.py)
                adapter = self.adapters.acquire() if self._lora is not None else None
                self._call.adapter = (adapter,)
                try:
                    if self._lora is not None:
                        self._use_adapter(adapter)
                    results: list[Completion | None] = [None] * len(requests)
                    groups: dict[int, list[int]] = {}
                    for i, req in enumerate(requests):
                        groups.setdefault(len(req.prompt_ids), []).append(i)
                    for idx in groups.values():
                        for i, completion in zip(idx, self._generate_group([requests[i] for i in idx])):
                            results[i] = completion
                finally:
                    self._call.adapter = None
                    self.adapters.release(adapter)
                with self._abort_lock:
                    self._aborts += sum(c.finish_reason == "abort" for c in results)  # type: ignore[union-attr]
                return results  # type: ignore[return-value]
        finally:
            with self._abort_lock:
                for r in rids:
                    self._progress.pop(r, None)
                    self._aborted.discard(r)

    def _check_request(self, req: Request) -> None:
        if not isinstance(req, Request):
            raise EngineError(f"generate: expected Request, got {type(req).__name__}")
        if not isinstance(req.rid, str) or not req.rid:
            raise EngineError(f"generate: request rid must be a non-empty string, got {req.rid!r}")
        if not isinstance(req.params, SamplingParams):
            raise EngineError(f"generate: request {req.rid!r} params must be SamplingParams")
        if len(req.prompt_ids) == 0:
            raise EngineError(f"generate: request {req.rid!r} has an empty prompt")
        bad = [t for t in req.prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._vocab]
        if bad:
            raise EngineError(f"generate: request {req.rid!r} has token ids outside [0, {self._vocab}): {bad[:5]}")
        bad = routed_start_error(req)
        if bad:
            raise EngineError(f"generate: {bad}")
        check_vision_request(req, self._config.image_token_id if self._vlm else None, self._config.model_type)
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise EngineError(f"generate: request {req.rid!r}: prompt length {len(req.prompt_ids)} + max_new_tokens "
                              f"{req.params.max_new_tokens} = {total} exceeds max_position_embeddings "
                              f"{self._max_positions}")

    def _check_ready(self) -> None:
        if self._released:
            raise EngineError(f"generate: memory {sorted(self._released)} is released; call resume_memory first")
        if self._stale:
            raise EngineError(f"generate: {len(self._stale)} weights not pushed since resume_memory "
                              f"(e.g. {sorted(self._stale)[0]!r}); finish a full weight sync first")
        if self._sync_open:
            raise EngineError("generate: a weight sync is in progress (update_weights without "
                              "finish_weight_update); the engine's weights are partial")

    @torch.no_grad()
    def probe_activations(self, token_ids: list[int]) -> dict[str, Any]:
        """One forward of `token_ids` with taps (mtrain.models.taps): {"taps": {point: [tokens, hidden]},
        "logprobs": float32 [len - 1], log p(token_ids[t + 1] | token_ids[:t + 1]) at temperature 1}.
        For the logprob-gap diagnostic (mtrain/gap_probe.py); runs between requests, like a weight update."""
        from mtrain.models.taps import Taps, hf_style_points

        with self._model_lock:
            self._check_ready()
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            with Taps(hf_style_points(self._model)) as taps:
                logits = self._model(input_ids=ids, use_cache=False).logits[0]
        logp = torch.log_softmax(logits[:-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        return {"taps": taps.captures, "logprobs": logp.gather(1, ids[0, 1:, None])[:, 0]}
