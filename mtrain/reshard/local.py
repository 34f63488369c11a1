"""Resharding inside one process: every source shard is in memory here (converters, tests, simulation)."""
from __future__ import annotations

import torch

from mtrain.reshard.executor import Executor
from mtrain.reshard.planner import Plan, TensorRef

Key = tuple[int, int, str]


def reshard_in_memory(plan: Plan, sources: dict[Key, torch.Tensor] | callable, *, dtype: torch.dtype,
                      backend: str = "auto", bucket_bytes: int = 256 << 20, device="cpu") -> dict[Key, torch.Tensor]:
    """Materialise every destination tensor of `plan` from `sources` (a dict or a ref -> tensor callable)."""
    lookup = sources if callable(sources) else (lambda ref: _get(sources, ref))
    out = {k: torch.empty(ref.shape, dtype=dtype, device=device) for k, ref in plan.dst_tensors.items()}
    for owner in sorted(set(plan.owner.get(k[0], k[0]) for k in plan.dst_tensors)):
        ex = Executor(plan, owner, lookup, dtype=dtype, src_everywhere=True, backend=backend,
                      bucket_bytes=bucket_bytes, device=device)
        ex.write_into(lambda ref: out[(ref.rank, ref.chunk, ref.name)])
    return out


def _get(store: dict, ref: TensorRef) -> torch.Tensor:
    try:
        return store[(ref.rank, ref.chunk, ref.name)]
    except KeyError:
        raise KeyError(f"missing source tensor {ref.name} (rank {ref.rank}, chunk {ref.chunk})") from None
