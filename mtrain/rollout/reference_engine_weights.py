"""Weights and memory of the CPU reference engine: pushed and pulled updates, the version they end with, and the
release/resume of weight memory (a mixin of ReferenceEngine, reference_engine.py, which owns the state it uses)."""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PretrainedConfig

from mtrain.rollout.protocol import MEMORY_TAGS, EngineError


class ReferenceWeights:
    """update_weights / pull_weights / finish_weight_update, release_memory / resume_memory, flush_cache."""

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
            self._written |= seen
            self._sync_open = True

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
                self._written |= set(names)
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
            self._written = set()

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

