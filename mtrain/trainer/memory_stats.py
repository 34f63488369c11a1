"""Bytes of training state on this rank, measured from the live objects (for memory_math's predictions).

`state_bytes(actor)` counts what the per-GPU formulas of examples/deepseek_v3/full/memory_math.py count:
the model parameters of this rank's chunks, the gradient buffers DDP allocated for them (main_grad, fp32 with
grad_reduce_in_fp32), and the optimizer state (Adam moments, and fp32 master copies where the parameters are
bf16: what the distributed optimizer holds for this rank's shard). Activations are not included: they exist
only inside a step. `peak_rss_bytes()` is the process's peak resident memory (ru_maxrss), which also holds
the Python runtime, torch and Megatron's code, the engine on the leader, and allocator slack.
"""
from __future__ import annotations

import resource

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_bytes(actor) -> dict[str, int]:
    from megatron.core.utils import unwrap_model
    params = sum(_nbytes(p) for c in unwrap_model(actor.chunks) for p in c.parameters())
    grads = 0
    for c in actor.chunks:
        for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
            grads += _nbytes(buf.grad_data)
    optim = 0
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in (inner.state.values() if inner is not None else []):
            optim += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in getattr(sub, "shard_fp32_from_float16_groups", []) or []:
            # None under optim.cpu_offload (precision-aware: the hybrid optimizer holds the fp32 masters, on the
            # host, and they are counted in its state above as `master_param`)
            optim += sum(_nbytes(p) for p in group if p is not None)
    return {"params": params, "grads": grads, "optim": optim}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_metrics(actor, pp_rank: int) -> dict[str, float]:
    """Per pipeline stage, max over the stage's ranks: bytes of each kind of state. Gathered from every rank
    (one small collective per step), so the rank that reports training metrics (the last stage) has them all."""
    import torch.distributed as dist

    from mtrain.dist import train_group
    mine = _local_metrics(actor, pp_rank)
    group = train_group()  # the training ranks (engine ranks of separate placement hold no training state)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    out: dict[str, float] = {}
    for g in gathered:
        for k, v in g.items():
            out[k] = max(out.get(k, v), v)
    return out


def _local_metrics(actor, pp_rank: int) -> dict[str, float]:
    b = state_bytes(actor)
    out = {f"mem/stage{pp_rank}/{k}_bytes_max": float(v) for k, v in b.items()}
    out[f"mem/stage{pp_rank}/state_bytes_max"] = float(sum(b.values()))
    out[f"mem/stage{pp_rank}/peak_rss_bytes_max"] = float(peak_rss_bytes())
    if torch.cuda.is_available():  # the GPU's own peak (weights, grads, optimizer, activations, allocator)
        out[f"mem/stage{pp_rank}/cuda_peak_bytes_max"] = float(torch.cuda.max_memory_allocated())
        # what the caching allocator held at its peak (allocated + slack), and the device's use by every process
        # now (an engine colocated in its own processes included): the memory plan's slack and outside terms
        out[f"mem/stage{pp_rank}/cuda_reserved_peak_bytes_max"] = float(torch.cuda.max_memory_reserved())
        free, total = torch.cuda.mem_get_info()
        out[f"mem/stage{pp_rank}/device_used_bytes_max"] = float(total - free)
    return out
