"""Fixed-order MoE ops (Qwen3-MoE routing and the top-k combination) shared by the trainer's bitwise MoE layer
(mtrain/models/bitwise_moe.py) and the reference engine's bitwise forward (numerics.on_policy=bitwise).

Built on `mtrain.kernels.bitwise_ops` (tree sums, float64 transcendentals rounded to float32), so the routing and
the combination of a token depend on that token's row only: the same bits for any batch, sequence length or set of
other tokens routed to the same expert.

Semantics are transformers' Qwen3MoeSparseMoeBlock: softmax over all experts' router logits (float32), the top-k
probabilities, renormalised over the top k when norm_topk_prob. Ties in the top-k go to the lower expert id (a
stable sort), so both sides pick the same experts even where two probabilities round to the same float32.

Combination order (one fixed order on both sides): the k weighted expert outputs of a token are summed in ascending
expert id, the order transformers' eager loop adds them in, by the fixed tree over the k slots; products and sum
in float32, rounded once to the hidden states' dtype. The routing weights stay float32 (never rounded to bf16).
"""
from __future__ import annotations

from typing import Callable

import torch

from mtrain.kernels.bitwise_ops import exp, linear, silu_mul, tree_sum


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [..., E] -> (expert ids [..., k] int64 in top-k rank order, weights [..., k] float32).
    Differentiable in the weights (the sort's values are a gather of the probabilities)."""
    x = logits.float()
    e = exp(x - x.amax(dim=-1, keepdim=True).detach())  # a max is exact in any order
    probs = e / tree_sum(e)[..., None]
    # stable descending sort: equal probabilities keep ascending expert id (torch.topk's tie order is unspecified)
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :top_k], ids[..., :top_k]
    if norm_topk_prob:
        vals = vals / tree_sum(vals)[..., None]
    return ids, vals


def combine(expert_out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[..., k] * expert_out[..., k, :] in ascending expert id by the fixed tree; expert_out
    [..., k, H] (each expert's output, already rounded to the model dtype as a dense MLP's), ids and weights [..., k]
    as `route` returns them; float32 inside, the result in expert_out's dtype."""
    order = ids.argsort(dim=-1, stable=True)  # ids of one token are distinct: a total order
    w = weights.float().gather(-1, order)
    y = expert_out.float().gather(-2, order[..., None].expand(*order.shape, expert_out.shape[-1]))
    return tree_sum(y * w[..., None], dim=-2).to(expert_out.dtype)


def fused_experts(gate_up: torch.Tensor, down: torch.Tensor,
                  down_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear):
    """`moe`'s expert(e, rows) over fused expert tensors, gate_up [E, 2I, H] (gate rows, then up) and down [E, H, I]
    (transformers' Qwen3-MoE experts; SGLang's w13 / w2): SwiGLU by the bitwise ops. down_linear: the down
    projection's linear (the reference engine passes its tensor-parallel emulation)."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rows, gate_up[e]).chunk(2, dim=-1)
        return down_linear(silu_mul(gate, up), down[e])
    return expert


def moe(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
        expert: Callable[[int, torch.Tensor], torch.Tensor],
        every_expert: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE block over tokens x [n, H]: router logits by the fixed-order linear (rounded to x's dtype, as
    transformers' gate computes them in the hidden dtype), `route`, every selected expert's output from
    `expert(e, rows of x)` ([rows, H] in x's dtype; each side passes its own weights' SwiGLU), then `combine`.
    Returns (output [n, H] in x's dtype, expert ids [n, k] in top-k rank order). Experts run in ascending id; an
    expert no token chose is not run (each expert's rows are computed independently, so this changes no bits).

    every_expert (default: while a CUDA graph is being captured, i.e. SGLang's decode graphs): run every expert on
    every token and keep the chosen rows. Choosing the experts from `ids` reads them on the host, which a graph
    cannot; a row's bits do not depend on the other rows in the batch, so both ways give the same bits."""
    ids, weights = route(linear(x, router_weight), top_k, norm_topk_prob)
    out = x.new_zeros(x.shape[0], top_k, x.shape[-1])
    if every_expert is None:
        every_expert = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if every_expert:
        for e in range(router_weight.shape[0]):
            out = torch.where((ids == e)[..., None], expert(e, x)[:, None, :], out)
        return combine(out, ids, weights), ids
    for e in ids.unique().tolist():  # sorted
        rows, slots = (ids == e).nonzero(as_tuple=True)
        out = out.index_put((rows, slots), expert(e, x[rows]))  # out of place: differentiable
    return combine(out, ids, weights), ids
