"""Weights of the in-process SGLang engine: pushed and pulled buckets per TP rank, the finish that sets the version,
SGLang's own HF-names path and LoRA adapters from tensors (a mixin of SGLangEngine, sglang_engine.py, which owns the
state and the loop plumbing it uses)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from mtrain.rollout.protocol import EngineError
from mtrain.rollout.sglang_loader import FINISH_NAME, LOAD_DIRECT
from mtrain.rollout.sglang_wire import _marker_tensor, serialize_bucket


class SGLangWeights:
    """update_weights / finish_weight_update / pull_weights, load_lora_adapter / unload_lora_adapter."""

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
