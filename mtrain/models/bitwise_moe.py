"""The Megatron MoE layer of numerics.on_policy=bitwise (Qwen3-MoE shapes): routing, experts and combination by the
fixed-order ops of `mtrain.kernels.bitwise_moe_ops`, the same function the reference engine's bitwise forward calls.

Through Megatron's extension point only: the layer spec's MoE builder (functools.partial(MoELayer, submodules=...))
becomes one of `BitwiseMoELayer`, a subclass of MoELayer, with the experts' linear_fc1/linear_fc2 the bitwise
column/row-parallel linears. Megatron still builds its TopKRouter, SequentialMLP and token dispatcher, so the
parameters (`mlp.router.weight`, `mlp.experts.local_experts.{e}.linear_fc1/fc2.weight`), their names, the sharded
state dict and the expert-TP layout are Megatron's; checkpoints, converters and weight sync are unchanged. Only the
forward differs: it reads those parameters and computes the block token by token (no dispatcher):

- router logits = the bitwise linear of the router weight; softmax, top-k (ties: lower expert id), renormalised
  over the top k when norm_topk_prob (Megatron's moe_router_pre_softmax=False), as transformers' Qwen3-MoE does;
- each selected expert's SwiGLU through its own bitwise linears: under tensor parallelism (expert TP = TP, EP = 1)
  every rank holds every token (no sequence parallelism in this mode), fc1 computes its columns and fc2 finishes
  the fixed tree over the ranks' float32 partials, so each expert's output is the TP1 one, as in the dense MLP;
- the k weighted outputs are added in ascending expert id by the fixed tree, float32 inside, rounded once.

Expert parallelism is refused: its ranks hold different tokens and the alltoall dispatcher would move them, which
this token-by-token forward does not do. The choice of experts per token of the last forward is kept in
`mtrain_routes` ([s, b, k] int64, detached) so a test can set it beside the engine's.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from mtrain.kernels import bitwise_moe_ops as moe_ops
from mtrain.kernels import bitwise_ops as ops


class BitwiseMoELayer(MoELayer):
    """Megatron's MoELayer (router, experts, names and sharding kept) computed by `bitwise_moe_ops.moe`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        c = self.config
        if get_pg_size(self.ep_group) > 1:
            raise ValueError("numerics.on_policy=bitwise is not built for expert parallelism (parallel.ep > 1): EP "
                             "ranks hold different tokens and the bitwise MoE layer computes every token locally")
        if self.use_shared_expert or c.moe_latent_size:
            raise ValueError("numerics.on_policy=bitwise computes Qwen3-MoE blocks (no shared experts, no latent)")
        if c.moe_router_score_function != "softmax" or c.moe_router_enable_expert_bias or \
                (c.moe_router_topk_scaling_factor or 1.0) != 1.0 or c.moe_router_num_groups:
            raise ValueError("numerics.on_policy=bitwise computes the Qwen3-MoE router only (softmax, top-k, no "
                             "expert bias, groups or scaling)")
        if not c.gated_linear_unit:
            raise ValueError("numerics.on_policy=bitwise supports SwiGLU (gated) experts only")
        # pre_softmax=False is top-k then softmax over the k: the same weights as norm_topk_prob's renormalisation
        self.norm_topk_prob = not c.moe_router_pre_softmax
        self.mtrain_routes: torch.Tensor | None = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        expert = self.experts.local_experts[e]
        inter, _ = expert.linear_fc1(x)
        gate, up = torch.chunk(inter, 2, dim=-1)  # this rank's [gate | up] columns, as the dense MLP's
        out, _ = expert.linear_fc2(ops.silu_mul(gate, up))
        return out

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None, **kwargs):
        if intermediate_tensors is not None:
            raise ValueError("numerics.on_policy=bitwise: the MoE layer is not split for CUDA-graph capture")
        s, b, h = hidden_states.shape
        out, ids = moe_ops.moe(hidden_states.reshape(s * b, h), self.router.weight, self.config.moe_router_topk,
                               self.norm_topk_prob, self._expert)
        self.mtrain_routes = ids.detach().view(s, b, -1)
        return out.view(s, b, h), None


def _bitwise_experts(experts, fc: dict):
    """The experts builder (SequentialMLP, local spec) with bitwise fc1/fc2: partial (megatron-core 0.19) or
    ModuleSpec (0.16)."""
    if isinstance(experts, functools.partial) and isinstance(experts.keywords.get("submodules"), MLPSubmodules):
        kw = dict(experts.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], **fc)
        return functools.partial(experts.func, *experts.args, **kw)
    if isinstance(experts, ModuleSpec) and isinstance(experts.submodules, MLPSubmodules):
        return dataclasses.replace(experts, submodules=dataclasses.replace(experts.submodules, **fc))
    raise ValueError(f"numerics.on_policy=bitwise: MoE experts built by {experts!r} (grouped GEMM / TE) are not "
                     f"built for it; the local spec's SequentialMLP is")


def bitwise_moe_spec(mlp, fc: dict):
    """The MoE layer spec as a BitwiseMoELayer with bitwise expert linears (`fc`: linear_fc1/fc2 classes), or None
    when `mlp` is not Megatron's MoELayer."""
    if isinstance(mlp, functools.partial) and mlp.func is MoELayer:
        kw = dict(mlp.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], experts=_bitwise_experts(kw["submodules"].experts, fc))
        return functools.partial(BitwiseMoELayer, *mlp.args, **kw)
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
        sub = dataclasses.replace(mlp.submodules, experts=_bitwise_experts(mlp.submodules.experts, fc))
        return dataclasses.replace(mlp, module=BitwiseMoELayer, submodules=sub)
    return None
