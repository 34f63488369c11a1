"""On-policy distillation's teacher: a frozen Megatron-core model (forward only) that scores the student's samples.

Built like the KL reference model (an `Actor` with trainable=False: no DDP, no optimizer) on the policy's parallel
layout, from `algo.distill.teacher_path`'s HF weights; it scores exactly the rows the policy scored (this rank's
share of each minibatch), so multi-turn and partial-rollout batches need nothing special: the response mask
already holds only the model's tokens. Same tokenizer and vocabulary are checked before any work
(`mtrain.preflight_models`).

With `engine.offload_train` the teacher's parameters leave the device outside its forward (`ParamOffload`): the
engines' KV cache may use that memory while they generate.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from mtrain.layouts import model_layout
from mtrain.trainer.actor import Actor
from mtrain.trainer.engines import weight_loader


class ParamOffload:
    """Every parameter storage of a frozen model to host memory (storage resized to 0: the tensors stay valid
    objects) and back, as TrainOffload does for gradients and optimizer state."""

    def __init__(self, chunks, enabled: bool):
        self.chunks, self.enabled = chunks, enabled
        self._held: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def _tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for c in self.chunks:
            for t in list(c.parameters()) + list(c.buffers()):
                if t.numel():
                    seen.setdefault(t.untyped_storage().data_ptr(), t)
        return list(seen.values())

    @torch.no_grad()
    def offload(self) -> dict[str, float]:
        if not self.enabled or self._held:
            return {}
        t0, moved, pin = time.perf_counter(), 0, torch.cuda.is_available()
        for t in self._tensors():
            storage = t.untyped_storage()
            if not storage.resizable():
                continue
            nbytes = storage.nbytes()
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
            storage.resize_(0)
            self._held.append((t, host, nbytes))
            moved += nbytes
        return {"offload/teacher_bytes": float(moved), "time/teacher_offload": time.perf_counter() - t0}

    @torch.no_grad()
    def reload(self) -> dict[str, float]:
        if not self._held:
            return {}
        t0 = time.perf_counter()
        moved = 0
        for t, host, nbytes in self._held:
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).copy_(host)
            moved += nbytes
        self._held = []
        return {"reload/teacher_bytes": float(moved), "time/teacher_reload": time.perf_counter() - t0}


class Teacher:
    def __init__(self, cfg, rank: int, overrides: dict | None = None, offload: bool = False):
        path = Path(cfg.algo.distill.teacher_path)
        hf_config = dict(json.loads((path / "config.json").read_text()), num_nextn_predict_layers=0)
        tcfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(path), mcore_ckpt=None),
                                   algo=dataclasses.replace(cfg.algo, routing_replay="off"))
        load = weight_loader(tcfg, model_layout(hf_config, mtp=False), rank)
        self.model = Actor(tcfg, hf_config, load_weights=load, trainable=False, overrides=overrides)
        self.offloader = ParamOffload(self.model.chunks, offload)
        self.metrics: dict[str, float] = {}
        self.metrics.update(self.offloader.offload())

    def logprobs(self, batch):
        """[B, T-1] teacher logprobs of the sampled tokens (last pipeline stage; None elsewhere), at the rollout
        temperature as the student's; the parameters are on the device only during this forward."""
        self.metrics.update(self.offloader.reload())
        try:
            return self.model.logprobs(batch)
        finally:
            self.metrics.update(self.offloader.offload())

    def take_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
