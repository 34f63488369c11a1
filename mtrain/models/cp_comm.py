"""Autograd-aware gathers over the context-parallel group (gloo has no reduce_scatter, so backward is an
all_reduce and a slice)."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sum_grads: bool):
        ctx.group, ctx.sum_grads, ctx.n = group, sum_grads, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sum_grads:
            dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n:(r + 1) * ctx.n], None, None


def gather_cp(x: torch.Tensor, group, *, sum_grads: bool) -> torch.Tensor:
    """Every CP rank's `x` (equal shapes), concatenated along dim 0 in rank order.

    sum_grads=True: the result feeds different computations on each rank (keys/values that every rank's
    queries read), so a rank's gradient is the sum over ranks. sum_grads=False: every rank computes the same
    function of the result (the loss over the whole sequence), so each rank keeps its own slice's gradient."""
    return _GatherCP.apply(x, group, sum_grads)
