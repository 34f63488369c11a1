"""Megatron layers that compute with the fixed-order ops of `mtrain.kernels.bitwise_ops` (numerics.on_policy=bitwise).

They plug into Megatron's own extension points, the layer spec's submodules (norms, linear_qkv, linear_proj,
linear_fc1/fc2, core_attention, the MLP class) and a subclass of the output layer's class, so the model keeps
Megatron's parameters, names, sharded state dicts and parallel layout; only the arithmetic changes:

- Column-parallel linears compute their shard of the output columns, row by row (no reduction across ranks).
- Row-parallel linears reduce their local K slice by the fixed tree, all-gather the float32 partials and finish the
  same tree in rank order: with a power-of-two K slice per rank this is exactly the single-rank tree, so TP2 equals
  TP1 bit for bit (checked when the layer is built).
- RoPE moves into the core attention (the model is built with position_embedding_type="none") so that the angles
  are computed by the same code as the engine's.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from mtrain.kernels import bitwise_ops as ops


def _tp(layer) -> int:
    return get_pg_size(layer.tp_group)


class BitwiseRMSNorm(torch.nn.Module):
    """RMSNorm with a `weight` (Megatron's norm interface: config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class BitwiseColumnParallelLinear(ColumnParallelLinear):
    """This rank's output columns, each from its own row and column only."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        w = self.weight if weight is None else weight
        x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group) if _tp(self) > 1 else input_  # backward: all-reduce dgrad
        out = ops.linear(x, w)
        bias = None
        if self.bias is not None:
            if self.skip_bias_add:
                bias = self.bias
            else:
                out = out + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and _tp(self) > 1:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, bias


class BitwiseRowParallelLinear(RowParallelLinear):
    """Local tree over this rank's K slice, then the top of the same tree over the ranks' partials, in rank order."""

    def __init__(self, input_size, output_size, *args, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        problem = ops.row_parallel_slice_problem(input_size, _tp(self))
        if problem:
            raise ValueError(f"numerics.on_policy=bitwise with tensor parallelism: {problem}")

    def forward(self, input_):
        partial = ops.linear_fp32(input_, self.weight)
        if _tp(self) > 1:
            parts = gather_from_tensor_model_parallel_region(partial[..., None].contiguous(), group=self.tp_group)  # [..., N, tp]
            partial = ops.tree_sum(parts)
        out = partial.to(input_.dtype)
        if self.bias is None:
            return out, None
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias, None


class BitwiseMLP(MLP):
    """Megatron's MLP (parameters, gated fc1 layout and sharded state dict kept), SwiGLU by the fixed-order ops."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.config.gated_linear_unit:
            raise ValueError("numerics.on_policy=bitwise supports the SwiGLU (gated) MLP only")
        inter, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            inter = inter + bias
        gate, up = torch.chunk(inter, 2, dim=-1)
        out, out_bias = self.linear_fc2(ops.silu_mul(gate, up))
        return out, out_bias


class _EngineAttention(torch.autograd.Function):
    """Forward: the engine's attention kernel over the packed sequences (its bits). Backward: the varlen flash
    attention the default trainer uses, recomputed on the saved q, k, v (one launch per layer; the gradient needs no
    bitwise agreement)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, scale):
        from mtrain.kernels.bitwise_gpu import packed_paged_attention
        ctx.save_for_backward(q, k, v)
        ctx.cu, ctx.scale = list(cu), float(scale)
        return packed_paged_attention(q, k, v, ctx.cu, ctx.scale)

    @staticmethod
    def backward(ctx, grad):
        from mtrain.models.varlen_attention import causal_packed_attention
        q, k, v = ctx.saved_tensors
        cu = ctx.cu
        with torch.enable_grad():
            qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
            out = causal_packed_attention(qs, ks, vs, torch.tensor(cu, dtype=torch.int32, device=q.device), cu,
                                          max(b - a for a, b in zip(cu[:-1], cu[1:])), ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), grad)
        return gq, gk, gv, None, None


class BitwiseCoreAttention(MegatronModule):
    """Causal attention of each sequence with RoPE applied here (positions 0.. per sequence, or per packed
    sequence from `packed_seq_params.cu_seqlens_q`). query [s, b, np, hn], key/value [s, b, ng, hn] ->
    [s, b, np * hn]; packed: query [t, np, hn] (or [t, 1, np, hn]) -> [t, 1, np * hn]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, rope_theta: float = 10000.0,
                 **kwargs) -> None:
        super().__init__(config=config)
        self.rope_theta = float(rope_theta)
        self.scale = config.kv_channels ** -0.5 if config.softmax_scale is None else config.softmax_scale

    def _one(self, q, k, v):
        pos = torch.arange(q.shape[0])
        return ops.causal_attention(ops.rope(q, pos, self.rope_theta), ops.rope(k, pos, self.rope_theta), v,
                                    self.scale)

    def _packed_gpu(self, q, k, v, cu):
        """All packed sequences in one launch of the engine's attention kernel (kernels/bitwise_gpu.py)."""
        from mtrain.kernels.bitwise_gpu import packed_tables
        pos = packed_tables(cu, q.device)[2]  # each token's position in its sequence
        return _EngineAttention.apply(ops.rope(q, pos, self.rope_theta), ops.rope(k, pos, self.rope_theta), v, cu,
                                      self.scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:  # THD: [t, 1, heads, hn], sequences delimited by cu_seqlens
            if getattr(packed_seq_params, "mtrain_tree", None) is not None:
                raise ValueError("numerics.on_policy=bitwise: shared-prefix (tree) attention is not built for it")
            cu = getattr(packed_seq_params, "mtrain_host_cu_seqlens", None) or packed_seq_params.cu_seqlens_q.tolist()
            # qkv_format="thd": Megatron's Attention squeezes the dummy batch dimension before the core attention
            # ([t, heads, hn]) and reshapes what it returns to [t, 1, heads * hn] itself.
            q, k, v = (x[:, 0] if x.dim() == 4 else x for x in (query, key, value))
            if query.is_cuda:
                out = self._packed_gpu(q, k, v, list(cu))
            else:
                out = torch.cat([self._one(q[a:b], k[a:b], v[a:b]) for a, b in zip(cu[:-1], cu[1:]) if b > a])
            return out.reshape(out.shape[0], 1, -1)
        elif query.is_cuda:  # [s, b, ...]: b sequences of s tokens, packed batch-major
            s_len, b = query.shape[:2]
            flat = [x.transpose(0, 1).reshape(b * s_len, *x.shape[2:]) for x in (query, key, value)]
            out = self._packed_gpu(*flat, [i * s_len for i in range(b + 1)]).reshape(b, s_len, *query.shape[2:])
            out = out.transpose(0, 1)
        else:
            out = torch.stack([self._one(query[:, i], key[:, i], value[:, i]) for i in range(query.shape[1])], dim=1)
        return out.reshape(out.shape[0], out.shape[1], -1)


def _norm(spec):
    """The bitwise norm where the spec has a norm, the identity (no qk-norm) kept as it is."""
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return spec if module is None or module is IdentityOp else BitwiseRMSNorm


def _bitwise_mlp(mlp):
    """The dense MLP's spec with bitwise fc1/fc2 inside a BitwiseMLP (a MoE layer's: a BitwiseMoELayer, bitwise_moe.py).
    megatron-core 0.16 gives a ModuleSpec of MLP; 0.19 a builder, functools.partial(MLP.as_mlp_submodule,
    submodules=...), which TransformerLayer calls as is."""
    fc = {"linear_fc1": BitwiseColumnParallelLinear, "linear_fc2": BitwiseRowParallelLinear}
    if isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP:
        kw = dict(mlp.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], **fc)
        return functools.partial(BitwiseMLP.as_mlp_submodule, *mlp.args, **kw)
    if isinstance(mlp, ModuleSpec) and mlp.module is MLP:
        return dataclasses.replace(mlp, module=BitwiseMLP, submodules=dataclasses.replace(mlp.submodules, **fc))
    from mtrain.models.bitwise_moe import bitwise_moe_spec  # Qwen3-MoE layers: mtrain/models/bitwise_moe.py
    moe = bitwise_moe_spec(mlp, fc)
    if moe is None:
        raise ValueError(f"numerics.on_policy=bitwise: an MLP built by {mlp!r} is not built for it")
    return moe


def bitwise_layer_spec(layer_spec: ModuleSpec, rope_theta: float) -> ModuleSpec:
    """A local TransformerLayer spec with every computing submodule replaced by its bitwise counterpart."""
    sub = layer_spec.submodules
    attn = sub.self_attention
    a_sub = dataclasses.replace(
        attn.submodules,
        linear_qkv=BitwiseColumnParallelLinear,
        core_attention=ModuleSpec(module=BitwiseCoreAttention, params={"rope_theta": rope_theta}),
        linear_proj=BitwiseRowParallelLinear,
        q_layernorm=_norm(attn.submodules.q_layernorm),
        k_layernorm=_norm(attn.submodules.k_layernorm),
    )
    mlp = _bitwise_mlp(sub.mlp)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        sub,
        input_layernorm=BitwiseRMSNorm,
        self_attention=dataclasses.replace(attn, submodules=a_sub),
        pre_mlp_layernorm=BitwiseRMSNorm,
        mlp=mlp,
    ))


def bitwise_block_spec(block, rope_theta: float):
    """The decoder block spec with bitwise layers and final norm."""
    return dataclasses.replace(block, layer_specs=[bitwise_layer_spec(s, rope_theta) for s in block.layer_specs],
                               layer_norm=BitwiseRMSNorm)


def bitwise_mapped(mapped):
    """(the mapped HF config with RoPE moved into the core attention, rope theta); one line for what the mode
    cannot compute bit for bit yet."""
    kw = mapped.model_kwargs
    moe = mapped.config_kwargs.get("num_moe_experts") and mapped.model_type != "qwen3_moe"  # bitwise_moe.py
    if mapped.mla or mapped.vision or moe or \
            kw.get("position_embedding_type") != "rope" or kw.get("rope_scaling") or kw.get("rotary_percent", 1.0) != 1.0:
        raise ValueError(f"numerics.on_policy=bitwise supports Llama, Qwen2/3 and Qwen3-MoE shapes with plain RoPE; "
                         f"{mapped.model_type} with these settings is not built for it")
    model = dict(kw, position_embedding_type="none")
    return dataclasses.replace(mapped, model_kwargs=model), float(kw["rotary_base"])


def use_bitwise_output_layer(model) -> None:
    """Make the GPTModel's output layer (built by GPTModel itself, outside the layer spec) a bitwise one: same
    parameters and state, the subclass's forward."""
    if getattr(model, "output_layer", None) is not None:
        model.output_layer.__class__ = BitwiseColumnParallelLinear
