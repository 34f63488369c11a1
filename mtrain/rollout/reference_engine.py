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
"""
from __future__ import annotations

import concurrent.futures
import difflib
import glob
import os
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from mtrain.rollout.batcher import Batcher
from mtrain.rollout.lora_adapters import AdapterVersions
from mtrain.rollout.protocol import (MEMORY_TAGS, Completion, EngineError, Request, RolloutEngine, SamplingParams,
                                     TokenDelta, emit_tokens, routed_start_error)
from mtrain.rollout.vision_requests import check_vision_request, vision_prefill


def as_hf_config(config: dict[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A HF config from a `config.json` dict (or a PretrainedConfig, returned as is)."""
    if isinstance(config, PretrainedConfig):
        return config
    if not isinstance(config, dict) or "model_type" not in config:
        raise EngineError(f"ReferenceEngine needs a HF config dict with a 'model_type' or a PretrainedConfig, "
                          f"got {type(config).__name__}")
    rest = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **rest)


def peft_plain_name(name: str) -> str:
    """A PEFT-injected module's parameter name as HF/PEFT files spell it: q_proj.base_layer.weight -> q_proj.weight,
    q_proj.lora_A.default.weight -> q_proj.lora_A.weight (the adapter table's HF names, mtrain/layouts/lora.py)."""
    return name.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def hf_disk_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """On-disk (checkpoint) name -> a tensor sharing memory with the live model, for every stored weight.

    transformers 5 keeps MoE experts fused in memory (`experts.gate_up_proj [E, 2I, H]`) while checkpoints
    store `experts.{e}.gate_proj.weight`. We reuse transformers' own save-time conversion
    (`revert_weight_conversion`, the reverse of the load-time `WeightConverter`s): applied to the live
    parameters its reverse ops (chunk/unbind) return *views*, so copying into a view writes the fused
    parameter. Tied aliases (lm_head when tie_word_embeddings) are dropped, as save_pretrained does.
    """
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    state, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # parameters + persistent buffers
        if name in tied or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        state[peft_plain_name(name)] = tensor
    views = revert_weight_conversion(model, state)
    live = {t.untyped_storage().data_ptr() for t in state.values()}
    for name, view in views.items():
        # A conversion that concatenates on save would hand us a copy: writes would be lost silently.
        if view.untyped_storage().data_ptr() not in live:
            raise EngineError(f"weight {name!r}: transformers' conversion yields a copy, not a view of the "
                              f"model's memory; the reference engine cannot write it in place")
    return views


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """One token from a float32 [vocab] logits row; returns (token, logprob before top-k/top-p).

    Sampling convention (SGLang's torch path): sort probs descending (stable), zero ranks >= top_k, zero
    tokens whose preceding cumulative prob already exceeds top_p, then inverse-CDF with ONE float64 uniform
    drawn from the request's own generator: the draw count is fixed per step, so results are reproducible
    and independent of batching.
    """
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs, order = torch.sort(logp.exp(), descending=True, stable=True)
    if params.top_k != -1:
        probs[params.top_k:] = 0.0
    if params.top_p < 1.0:
        probs[(torch.cumsum(probs, dim=0) - probs) > params.top_p] = 0.0
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    pos = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs.numel() - 1))
    token = int(order[pos])
    return token, float(logp[token])


def top_alternatives(logits: torch.Tensor, params: SamplingParams) -> list[tuple[int, float]]:
    """The `params.top_logprobs` most likely (token, logprob) of a float32 [vocab] logits row, in the distribution
    `sample_token`'s logprob comes from (log_softmax(logits / T); T = 1 when greedy), most likely first."""
    logp = torch.log_softmax(logits if params.greedy else logits / params.temperature, dim=-1)
    values, ids = torch.topk(logp, params.top_logprobs)
    return [(int(i), float(v)) for i, v in zip(ids, values)]


class ReferenceEngine(RolloutEngine):
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

    # ---------------------------------------------------------------- weights
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def hf_config(self) -> PretrainedConfig:
        return self._config

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF on-disk name -> (shape, dtype) of every weight update_weights accepts (tied lm_head absent)."""
        return {name: (tuple(v.shape), v.dtype) for name, v in self._views.items()}

    def update_weights(self, rank_tensors: list[list[tuple[str, torch.Tensor]]]) -> None:
        self._check_alive("update_weights")
        if not isinstance(rank_tensors, (list, tuple)) or len(rank_tensors) != 1:
            n = len(rank_tensors) if isinstance(rank_tensors, (list, tuple)) else type(rank_tensors).__name__
            raise EngineError(f"update_weights: the reference engine has tp_size=1, expected tensors for 1 rank, got {n}")
        with self._model_lock:
            if "weights" in self._released:
                raise EngineError("update_weights: weights are released; call resume_memory(('weights',)) first")
            bucket = list(rank_tensors[0])
            seen: set[str] = set()
            for item in bucket:  # check the whole bucket before writing any of it
                name, tensor = item
                self._check_tensor(name, tensor, seen)
                seen.add(name)
            with torch.no_grad():
                for name, tensor in bucket:
                    self._views[name].copy_(tensor)
            self._stale -= seen
            self._sync_open = True

    # ---------------------------------------------------------------- LoRA adapters
    # Adapters live in PEFT adapter slots ("slot0", "slot1", ...: injected once each, reused), as SGLang's live in its
    # LoRA memory pool: a load writes a free slot in place (a copy of A/B, no module construction), an unload frees it.
    def load_lora_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Add adapter `name`: tensors by the adapter table's HF names (q_proj.lora_A.weight, full shapes), config
        PEFT's adapter_config (r, lora_alpha, target_modules as this engine was built with). Nothing is written
        unless every adapter weight is given once with the right shape."""
        self._check_alive("load_lora_adapter")
        if self._lora is None:
            raise EngineError("load_lora_adapter: this engine was built without LoRA (lora=None)")
        want = {k: config.get(k) for k in ("r", "lora_alpha", "target_modules")}
        have = {"r": self._lora["r"], "lora_alpha": float(self._lora["lora_alpha"]),
                "target_modules": list(self._lora["target_modules"])}
        if {**want, "lora_alpha": float(want["lora_alpha"] or 0)} != have:
            raise EngineError(f"load_lora_adapter({name!r}): config {want} differs from the engine's {have}")
        with self._model_lock:
            if name in self._slot_of:
                raise EngineError(f"load_lora_adapter: adapter {name!r} is already loaded")
            slot = self._free_slot()
            params = self._slot_params(slot)
            extra, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
            if extra or missing:
                raise EngineError(f"load_lora_adapter({name!r}): unknown {extra[:3]}, missing {missing[:3]} "
                                  f"(of {len(params)} adapter weights)")
            for k, t in tensors.items():
                if tuple(t.shape) != tuple(params[k].shape):
                    raise EngineError(f"load_lora_adapter({name!r}): {k!r} has shape {tuple(t.shape)}, "
                                      f"the adapter holds {tuple(params[k].shape)}")
            with torch.no_grad():
                for k, t in tensors.items():
                    params[k].copy_(t)
            self._slot_of[name] = slot

    def unload_lora_adapter(self, name: str) -> None:
        self._check_alive("unload_lora_adapter")
        with self._model_lock:
            if name == self.adapters.active:
                raise EngineError(f"unload_lora_adapter: {name!r} is the active adapter")
            if name not in self._slot_of:
                raise EngineError(f"unload_lora_adapter: no adapter {name!r} (loaded: {self._adapter_names()})")
            del self._slot_of[name]

    def adapter_state(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """HF name -> tensor of adapter `name` (default: the active one), as the engine holds it."""
        name = name or self.adapters.active
        return {k: v.detach() for k, v in self._slot_params(self._slot_of[name]).items()} if name else {}

    def _adapter_names(self) -> list[str]:
        return sorted(self._slot_of)

    def _free_slot(self) -> str:
        """A PEFT adapter slot no loaded adapter holds; a new one is injected when all are taken."""
        import peft
        free = [s for s in self._slot_cache if s not in self._slot_of.values()]
        if free:
            return free[0]
        slot = f"slot{len(self._slot_cache)}"
        with warnings.catch_warnings():  # "multiple adapters in the model": one slot per live version, on purpose
            warnings.simplefilter("ignore", UserWarning)
            peft.inject_adapter_in_model(peft.LoraConfig(lora_dropout=0.0, **self._lora), self._model,
                                         adapter_name=slot)
        self._model.to(self._dtype).requires_grad_(False)
        self._slot_params(slot)  # every injected slot is in _slot_cache from here on
        return slot

    def _slot_params(self, slot: str) -> dict[str, torch.nn.Parameter]:
        """The HF name (the adapter table's) -> PEFT parameter of adapter slot `slot` (built once per slot)."""
        if slot in self._slot_cache:
            return self._slot_cache[slot]
        out = self._slot_cache[slot] = {}
        for pname, p in self._model.named_parameters():
            for ab in ("lora_A", "lora_B"):
                tag = f".{ab}.{slot}."
                if tag in pname:
                    out[pname.replace(".base_layer.", ".").replace(tag, f".{ab}.")] = p
        return out

    def _use_adapter(self, name: str | None) -> None:
        """PEFT layers compute with adapter `name` (None: the base alone). Called under the model lock."""
        from peft.tuners.lora import LoraLayer
        for m in self._model.modules():
            if isinstance(m, LoraLayer):
                if name is None:
                    m.enable_adapters(False)
                else:
                    m.enable_adapters(True)
                    m.set_adapter(self._slot_of[name])
        self._model.requires_grad_(False)  # set_adapter marks the adapter trainable

    def pull_weights(self, jobs: list, version: int | None = None) -> None:
        """Pull mode: the same engine-side code SGLang's loader runs (`pull_protocol.run_pull`), on this engine's
        HF-layout parameters, in-process (no IPC). Casts like the kernel does (fp32/bf16/fp16)."""
        from mtrain.reshard.targets import LoaderError
        from mtrain.reshard.pull_protocol import PullSender, PullState, run_pull

        self._check_alive("pull_weights")
        if not isinstance(jobs, (list, tuple)) or len(jobs) != 1:
            raise EngineError(f"pull_weights: the reference engine has tp_size=1, expected 1 job, got {jobs!r:.60}")
        if self._pull is None:
            self._pull = (PullSender(1), PullState())
        sender, state = self._pull
        with self._model_lock:
            if "weights" in self._released:
                raise EngineError("pull_weights: weights are released; call resume_memory(('weights',)) first")
            if jobs[0] is not None:
                try:
                    names, _ = run_pull(self._views, sender.payload(0, jobs[0], False, torch.empty(0)), state)
                except LoaderError as e:
                    sender.forget()
                    raise EngineError(f"pull_weights: {e}") from None
                sender.confirm(0, jobs[0])
                self._stale -= set(names)
                self._sync_open = True
        if version is not None:
            self.finish_weight_update(version)

    def _check_tensor(self, name: str, tensor: Any, seen: set[str]) -> None:
        if name not in self._views:
            close = difflib.get_close_matches(str(name), list(self._views), n=3)
            tied = " (tied to the embedding, not a separate weight)" if name in (
                getattr(self._model, "all_tied_weights_keys", None) or {}) else ""
            raise EngineError(f"update_weights: unknown parameter {name!r}{tied}; closest HF names: {close}")
        if name in seen:
            raise EngineError(f"update_weights: parameter {name!r} appears twice in one bucket")
        if not isinstance(tensor, torch.Tensor):
            raise EngineError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        want = self._views[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise EngineError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                              f"the engine expects {tuple(want.shape)}")
        if tensor.dtype != want.dtype and not self._allow_dtype_cast:
            raise EngineError(f"update_weights: {name!r} has dtype {tensor.dtype}, the engine holds {want.dtype} "
                              f"(pass allow_dtype_cast=True to cast)")

    def finish_weight_update(self, version: int) -> None:
        self._check_alive("finish_weight_update")
        if isinstance(version, bool) or not isinstance(version, int):
            raise EngineError(f"finish_weight_update: version must be an int, got {version!r}")
        with self._model_lock:
            if "weights" in self._released:
                raise EngineError("finish_weight_update: weights are released; resume and push them first")
            if self._stale:
                missing = sorted(self._stale)
                raise EngineError(f"finish_weight_update({version}): {len(missing)} parameters were not written since "
                                  f"the weights were resumed: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
            self._version = version
            self._sync_open = False

    # ---------------------------------------------------------------- memory
    def release_memory(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = self._check_tags("release_memory", tags)
        if not self._model_lock.acquire(blocking=False):  # SGLang also requires an idle engine
            raise EngineError("release_memory: generate() or a weight update is running")
        try:
            for tag in tags:
                if tag in self._released:
                    raise EngineError(f"release_memory: {tag!r} is already released")
            if "weights" in tags:
                for tensor, _ in self._storages:
                    tensor.untyped_storage().resize_(0)  # really gives the bytes back
            # kv_cache: KV lives only inside one generate() call, so there is nothing left to drop; the tag is
            # tracked so that generating without resuming it fails here as it would in SGLang.
            self._released.update(tags)
        finally:
            self._model_lock.release()

    def resume_memory(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        tags = self._check_tags("resume_memory", tags)
        with self._model_lock:
            for tag in tags:
                if tag not in self._released:
                    raise EngineError(f"resume_memory: {tag!r} was not released")
            if "weights" in tags:
                with torch.no_grad():
                    for tensor, nbytes in self._storages:
                        tensor.untyped_storage().resize_(nbytes)
                        # garbage until pushed (SGLang without a CPU backup); NaN makes misuse visible
                        tensor.fill_(float("nan") if tensor.is_floating_point() else 0)
                self._stale = set(self._views)
            self._released.difference_update(tags)

    def _check_tags(self, op: str, tags: Iterable[str]) -> tuple[str, ...]:
        self._check_alive(op)
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        if not tags:
            raise EngineError(f"{op}: no tags given (use {MEMORY_TAGS})")
        for tag in tags:
            if tag not in MEMORY_TAGS:
                raise EngineError(f"{op}: unknown memory tag {tag!r}; known: {MEMORY_TAGS}")
        return tags

    def flush_cache(self) -> None:
        # No prefix cache survives a generate() call here, so KV from old weights can never be reused.
        self._check_alive("flush_cache")

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
                # for the model lock; in stream mode (pause_in_place) LoRA is refused by config_checks)
                adapter = self.adapters.acquire() if self._lora is not None else None
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

    def _is_aborted(self, rid: str) -> bool:
        with self._abort_lock:
            return rid in self._aborted

    @torch.no_grad()
    def _generate_group(self, reqs: list[Request]) -> list[Completion]:
        """Decode requests that share one prompt length, in lock step, with one KV cache."""
        outputs: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[float]] = [[] for _ in reqs]
        versions: list[list[int]] = [[] for _ in reqs]  # per token: the weights that produced it (pause_in_place)
        tops: list[list | None] = [[] if r.params.top_logprobs else None for r in reqs]
        finish: list[str | None] = [None] * len(reqs)
        gens = []
        for req in reqs:
            seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
            gens.append(torch.Generator().manual_seed(seed))
        alive = list(range(len(reqs)))  # rows of the current batch -> request index
        cache = DynamicCache(config=self._model.config)
        length = len(reqs[0].prompt_ids)
        input_ids = torch.tensor([r.prompt_ids for r in reqs], dtype=torch.long)
        positions = torch.arange(length).unsqueeze(0)
        vision_kwargs, deltas = {}, None
        routed: list[list[torch.Tensor]] = [[] for _ in reqs]  # per request: [tokens, L, k] per forward
        while True:
            self._gate()  # a pause in place stops here; the KV cache of every row is kept across it
            # abort is checked between decoding steps (and before the prefill of a queued group)
            for i in alive:  # a request that finished last step stays finished (its stop token is in the output)
                if finish[i] is None and self._is_aborted(reqs[i].rid):
                    finish[i] = "abort"
            keep = [row for row, i in enumerate(alive) if finish[i] is None]
            if len(keep) != len(alive):
                if not keep:
                    break
                if cache.get_seq_length() > 0:
                    cache.batch_select_indices(torch.tensor(keep))
                input_ids, alive = input_ids[keep], [alive[row] for row in keep]
                if deltas is not None:
                    deltas = deltas[keep]
            prefill = cache.get_seq_length() == 0
            if self._vlm and prefill:  # [3, B, L] multimodal positions of the rows still alive; images enter here only
                vision_kwargs, position_ids, deltas = vision_prefill(self._model, [reqs[i] for i in alive], input_ids)
            elif self._vlm:
                position_ids = (positions + deltas).view(1, -1, 1).expand(3, -1, -1)
                vision_kwargs = {}
            else:
                position_ids = positions.expand(len(alive), -1)
            if self._routing is not None:
                self._routing.start(input_ids.shape)
            logits = self._model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1, **vision_kwargs).logits[:, -1, :].float()
            if self._routing is not None:
                for row, rows in enumerate(self._routing.finish()):
                    routed[alive[row]].append(rows)
            next_ids = []
            for row, i in enumerate(alive):
                params = reqs[i].params
                token, logprob = sample_token(logits[row], params, gens[i])
                outputs[i].append(token)
                logprobs[i].append(logprob)
                versions[i].append(self._version)
                if tops[i] is not None:
                    tops[i].append(top_alternatives(logits[row], params))
                next_ids.append(token)
                if token in params.stop_token_ids:
                    finish[i] = "stop"
                elif len(outputs[i]) >= params.max_new_tokens:
                    finish[i] = "length"
            with self._abort_lock:
                for i in alive:
                    self._progress[reqs[i].rid] = len(outputs[i])
            for i in alive:  # streaming: this step's token of every request that asked for deltas
                if reqs[i].on_tokens is not None:
                    emit_tokens(reqs[i], TokenDelta([outputs[i][-1]], [logprobs[i][-1]],
                                                    [tops[i][-1]] if tops[i] is not None else None))
            if self._decode_delay_s:
                time.sleep(self._decode_delay_s)
            input_ids = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)
            positions = torch.tensor([[length]])
            length += 1
            if all(finish[i] is not None for i in alive):
                break
        return [Completion(rid=r.rid, prompt_ids=list(r.prompt_ids), output_ids=outputs[i], logprobs=logprobs[i],
                           finish_reason=finish[i], weight_version=self._version,  # type: ignore[arg-type]
                           # only when an update in place fell inside the request (else all weight_version)
                           token_versions=versions[i] if any(v != self._version for v in versions[i]) else None,
                           top_logprobs=tops[i], vision=r.vision,
                           # none for a request aborted before its prefill, as SGLang gives none for one aborted in its queue
                           routed_experts=self._routed_from(routed[i], r.routed_experts_start),
                           routed_experts_start=r.routed_experts_start)
                for i, r in enumerate(reqs)]

    def _routed_from(self, per_forward: list[torch.Tensor], start: int) -> torch.Tensor | None:
        """A request's rows from input position `start` on, as SGLang's routed_experts_start_len returns them. Every
        row is recorded anyway (the forward routes every token): the saving is in what the caller receives."""
        if self._routing is None or not per_forward:
            return None
        return torch.cat(per_forward)[start:].clone()
