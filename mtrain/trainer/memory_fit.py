"""Colocated asynchrony keeps the engine and the trainer resident on the same GPU: refuse a run that cannot fit.

rollout.async=one_step|stream turns engine.colocate's release/resume off (trainer/decisions.py): while training runs
the engine keeps its weights and KV cache, SGLang's `mem_fraction_static` share of the GPU. What training needs at
least, per rank, from the parameters it holds (exact, counted on the built model): the weights (model.dtype), fp32
gradients, and Adam's state (fp32 master weights when the weights are not fp32, and two moments), the optimizer part
divided over data parallelism with the distributed optimizer. Activations and the allocator's slack come on top, so
the check refuses only runs that certainly do not fit; a run it lets through can still run out of memory.
On CPU engine and trainer share host memory and nothing is checked (the start-up line says so).
"""
from __future__ import annotations

from mtrain.memory_plan import GIB, optimizer_bytes


def training_bytes(params: int, weight_bytes: int, dp: int, distributed_optimizer: bool) -> float:
    """Lower bound of one rank's training memory: weights + fp32 grads + (fp32 master if needed + 2 Adam moments),
    the optimizer's share as mtrain/memory_plan.py counts it (that plan, run by preflight, adds activations)."""
    main, adam = optimizer_bytes(params, weight_bytes, dp if distributed_optimizer else 1, False)
    return params * (weight_bytes + 4) + main + adam


def fit_error(params: int, weight_bytes: int, dp: int, distributed_optimizer: bool, mem_fraction: float,
              device_bytes: int, mode: str) -> str | None:
    """None when the lower bound fits next to the engine's share, else the one-line reason."""
    train = training_bytes(params, weight_bytes, dp, distributed_optimizer)
    engine = mem_fraction * device_bytes
    if train + engine <= device_bytes:
        return None
    return (f"engine.mem_fraction_static: rollout.async={mode} keeps the engine resident while training runs, and "
            f"they do not fit one GPU: training needs at least {train / GIB:.1f} GiB per rank ({params / 1e6:.0f}M "
            f"parameters: weights, fp32 grads, Adam) + the engine's {mem_fraction} x {device_bytes / GIB:.1f} GiB = "
            f"{(train + engine) / GIB:.1f} GiB > {device_bytes / GIB:.1f} GiB; lower engine.mem_fraction_static, "
            f"shard the model over more ranks (parallel.tp/pp, data parallelism with the distributed optimizer) "
            f"or use rollout.async=off")


def check_colocated_fit(cfg, actor, device: str) -> str:
    """Raise ConfigError when colocated asynchrony cannot fit; returns what was checked (printed at start)."""
    from megatron.core import parallel_state as ps

    from mtrain.config import ConfigError

    mode = cfg.rollout.async_mode
    if device != "cuda":
        return (f"rollout.async={mode}: engine and trainer share host memory on CPU; no device-memory fit check")
    import torch

    params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    weight_bytes = torch.empty((), dtype=actor.dtype).element_size()
    device_bytes = torch.cuda.mem_get_info()[1]
    err = fit_error(params, weight_bytes, ps.get_data_parallel_world_size(),
                    cfg.optim.use_distributed_optimizer, cfg.engine.mem_fraction_static, device_bytes, mode)
    if err:
        raise ConfigError(err)
    train = training_bytes(params, weight_bytes, ps.get_data_parallel_world_size(), cfg.optim.use_distributed_optimizer)
    return (f"rollout.async={mode}: memory fit checked: training >= {train / GIB:.1f} GiB per rank + engine "
            f"{cfg.engine.mem_fraction_static} x {device_bytes / GIB:.1f} GiB <= the GPU")
