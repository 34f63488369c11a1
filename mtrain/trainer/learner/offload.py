"""engine.offload_train: the trainer's gradient buffers and optimizer state leave the device while engines generate.

Colocated, the engines' KV cache wants the memory that Megatron's gradient buffers (DDP `grad_data`, fp32) and the
optimizer's state (Adam moments, fp32 main parameters of bf16 models) hold between updates. `TrainOffload.offload`
copies every such storage to host memory and frees it on the device (`untyped_storage().resize_(0)`: the tensors and
every view of them stay valid objects and keep their identities); `reload` reallocates and copies back. Parameters
stay: the engines read them in place during pull sync. The same code runs on CPU, where the "device" is host memory
too: the bytes really move and the original storages really shrink to zero, so tests can check both.
"""
from __future__ import annotations

import time

import torch


def _storages(actor) -> list[torch.Tensor]:
    """One tensor per distinct storage: gradient buffers and optimizer state (never the parameters themselves),
    only those on the parameters' device: with `optim.cpu_offload` megatron-core already keeps the optimizer's state
    on the host (pinned, not resizable), and there is nothing to move (2 x H200, 2026-11-30: resize_ raised)."""
    params = {p.untyped_storage().data_ptr() for c in actor.chunks for p in c.parameters()}
    device = next(p.device for c in actor.chunks for p in c.parameters())
    found: dict[int, torch.Tensor] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.numel() and t.device == device:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                found.setdefault(ptr, t)

    for chunk in actor.chunks:
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            add(buf.grad_data)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            for v in state.values():
                add(v)
        for groups in (getattr(opt, "shard_fp32_from_float16_groups", None) or [],
                       getattr(opt, "fp32_from_float16_groups", None) or []):
            for group in groups:
                for t in group:
                    add(t)
    return list(found.values())


class TrainOffload:
    def __init__(self, actor, enabled: bool):
        self.actor, self.enabled = actor, enabled
        self._held: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (device tensor, host copy, nbytes)

    def storages(self) -> list[torch.Tensor]:
        """What leaves the device: one tensor per storage (a frozen model's offload moves its parameters)."""
        return _storages(self.actor)

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @torch.no_grad()
    def offload(self) -> dict[str, float]:
        if not self.enabled or self._held:
            return {}
        t0, moved, kept = time.perf_counter(), 0, 0
        pin = torch.cuda.is_available()
        for t in self.storages():
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if not storage.resizable():  # e.g. memory another library owns: it stays, and the metric says so
                kept += nbytes
                continue
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(flat)
            storage.resize_(0)
            self._held.append((t, host, nbytes))
            moved += nbytes
        if pin:
            torch.cuda.synchronize()
        return {"offload/bytes": float(moved), "offload/kept_bytes": float(kept),
                "time/offload": time.perf_counter() - t0}

    @torch.no_grad()
    def reload(self) -> dict[str, float]:
        if not self._held:
            return {}
        t0, moved = time.perf_counter(), 0
        for t, host, nbytes in self._held:
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).copy_(host)
            moved += nbytes
        self._held = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"reload/bytes": float(moved), "time/reload": time.perf_counter() - t0}
