"""LoRA adapters on megatron-core's parallel linear layers, attached to the built model (no megatron patching).

Each target module (a ColumnParallelLinear / RowParallelLinear, or TE's) gets a child ``lora`` module holding
its A/B parameters and a forward hook that adds ``s * B(A(dropout(x)))`` to the module's output. The base
parameters keep their names (checkpoints, layout tables and the resharding planner see them unchanged); the
adapters are named by the table rows of mtrain/layouts/lora.py, which also say how each A/B is sharded.

Tensor parallelism (the partial products reduced the way the base output is):
- column-parallel: A replicated, B split by output rows like the base. ``h = x A^T`` goes through
  copy_to_tensor_model_parallel_region (identity forward, all-reduce of dh backward: B is split, so each rank's
  dh is partial) -- or, with sequence parallelism, gather_from_sequence_parallel_region (A's gradient is then
  partial over the sequence shards: A is marked ``sequence_parallel`` so megatron all-reduces it like a norm).
- row-parallel: A split by input columns like the base, B replicated. ``h = x_r A_r^T`` is all-reduced
  (reduce_from_tensor_model_parallel_region) -- or reduce-scattered over the sequence with SP (B then marked
  ``sequence_parallel``).
- routed experts: megatron's dispatcher moves tokens; with expert-TP 1 (required) every expert linear is local.
A fused base (qkv, fc1) has one A/B per HF linear; the concatenated slice outputs are permuted into the base
output's row order on this rank (query-group interleaving, [gate_r; up_r]) by an index derived from the rules.
"""
from __future__ import annotations

import math
import zlib

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from mtrain.layouts.lora import LoraSpec, lora_layout
from mtrain.layouts.models import model_layout
from mtrain.layouts.table import ModelLayout, Weight


class LoraError(ValueError):
    """A LoRA setting the model cannot take (names the setting)."""


def _rows_of(rule, full: tuple[int, int], rank: int, world: int) -> tuple[int, list[int]]:
    """(shard rows, canonical row of every shard row; -1 for padding) under a sharding rule."""
    (nrows, _), rects = rule.shard(full, rank, world)
    canon = [-1] * nrows
    for r in rects:
        canon[r.row : r.row + r.nrows] = range(r.full_row, r.full_row + r.nrows)
    return nrows, canon


def _shard(full: torch.Tensor, rule, rank: int, world: int) -> torch.Tensor:
    (nr, nc), rects = rule.shard(tuple(full.shape), rank, world)
    out = full.new_zeros(nr, nc)
    for r in rects:
        out[r.row : r.row + r.nrows, r.col : r.col + r.ncols] = full[r.full_row : r.full_row + r.nrows,
                                                                      r.full_col : r.full_col + r.ncols]
    return out


def _init_a(key: str, shape: tuple[int, int]) -> torch.Tensor:
    """PEFT's A init (kaiming uniform, a=sqrt(5)) from a generator seeded by the row key: every rank that holds
    (part of) the same A draws the same full matrix, so replicated copies agree and split ones fit together."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: bound = 1/sqrt(in)
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


class LoraAdapter(torch.nn.Module):
    """The A/B pairs of one base linear and the arithmetic that adds their product to its output."""

    def __init__(self, slices: list[tuple[str, torch.Tensor, torch.Tensor]], perm: list[int] | None,
                 scaling: float, dropout: float, row_parallel: bool, tp_group, sequence_parallel: bool,
                 norm: dict | None):
        super().__init__()
        self.names = [n for n, _, _ in slices]
        for name, a, b in slices:
            holder = self
            if name:
                holder = torch.nn.Module()
                self.add_module(name, holder)
            holder.A = torch.nn.Parameter(a)
            holder.B = torch.nn.Parameter(b)
        # on the adapters' device: they are attached after the model moved there, so no .to() carries the buffer
        device = slices[0][1].device
        self.register_buffer("perm", torch.tensor(perm, device=device) if perm is not None else None,
                             persistent=False)
        self.scaling, self.row_parallel = scaling, row_parallel
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.tp_group, self.sequence_parallel, self.norm = tp_group, sequence_parallel, norm

    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        mods = [getattr(self, n) if n else self for n in self.names]
        return [(m.A, m.B) for m in mods]

    def _normed(self, x: torch.Tensor, module) -> torch.Tensor:
        """TE's LayerNormColumnParallelLinear takes the un-normed input: the adapter sees the normed one."""
        n = self.norm
        w = module.layer_norm_weight + (1 if n["zero_centered"] else 0)
        xf = x.float()
        if n["rms"]:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + n["eps"])
        else:
            y = torch.nn.functional.layer_norm(xf, (x.shape[-1],), eps=n["eps"])
        y = y.to(x.dtype) * w
        return y + module.layer_norm_bias if not n["rms"] and getattr(module, "layer_norm_bias", None) is not None else y

    def delta(self, x: torch.Tensor, module) -> torch.Tensor:
        if self.norm is not None:
            x = self._normed(x, module)
        x = self.dropout(x)
        tp = self.tp_group.size() > 1
        outs = []
        for a, b in self.pairs():
            h = torch.matmul(x, a.t())
            if self.row_parallel and tp:
                h = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                     if self.sequence_parallel else
                     tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
            elif tp:
                h = (tensor_parallel.gather_from_sequence_parallel_region(h, group=self.tp_group)
                     if self.sequence_parallel else
                     tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
            outs.append(torch.matmul(h, b.t()))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.perm is not None:
            out = out.index_select(-1, self.perm)
        return out * self.scaling


def _hook(module, args, output):
    delta = module.lora.delta(args[0], module)
    if isinstance(output, tuple):
        return (output[0] + delta.to(output[0].dtype),) + tuple(output[1:])
    return output + delta.to(output.dtype)


def _lora_sharded_state_dict(module, base_fn):
    """The module's own sharded state (megatron-core's), with each TP-split adapter tensor declared split along its
    axis (megatron would call every tensor it does not know replicated): a checkpoint then reshards the adapters,
    and their optimizer state, to any layout as it does the base weights."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = base_fn(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        split = {f"lora.{n}": p for n, p in module.lora.named_parameters() if getattr(p, "tensor_model_parallel", False)}
        if split:
            out.update(make_sharded_tensors_for_checkpoint(
                split, prefix, {k: p.partition_dim for k, p in split.items()}, sharded_offsets,
                tp_group=module.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out
    return sharded_state_dict


def _named_modules(chunks) -> list[dict[str, torch.nn.Module]]:
    from mtrain.reshard.megatron_side import unwrap
    return [dict(unwrap(c).named_modules()) for c in chunks]


def _build_adapter(module, base: Weight, rows: list[Weight], rank_in_group: int, world: int,
                   spec: LoraSpec, dropout: float, config) -> LoraAdapter:
    group = module.tp_group
    if group.size() != world:
        raise LoraError(f"{base.key}: the module's TP group ({group.size()}) and the layout's ({world}) differ")
    (mg,) = base.megatron
    row_parallel = type(mg.rule).__name__ == "Split" and mg.rule.dim == 1
    if getattr(module, "explicit_expert_comm", False) and world > 1:
        raise LoraError("model.lora.targets=experts needs expert tensor parallelism 1 (parallel.etp=1): the "
                        "dispatcher reduces expert outputs over expert-TP itself")
    slices, canon_to_cat, cat = [], {}, 0
    dtype, device = module.weight.dtype, module.weight.device
    for a_row, b_row, hf_part in zip(rows[0::2], rows[1::2], base.hf):
        name = a_row.megatron[0].name.rpartition(".lora")[2].strip(".").removesuffix("A").strip(".")
        a = _shard(_init_a(a_row.key, a_row.shape2d), a_row.megatron[0].rule, rank_in_group, world)
        n, canon = _rows_of(b_row.megatron[0].rule, b_row.shape2d, rank_in_group, world)
        for i, c in enumerate(canon):
            if c >= 0:
                canon_to_cat[hf_part.rows[0] + c] = cat + i
        cat += n
        b = torch.zeros(n, spec.rank)
        slices.append((name, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)))
    perm = None
    if not row_parallel:
        _, canon = _rows_of(mg.rule, base.shape2d, rank_in_group, world)
        perm = [canon_to_cat[c] for c in canon]
        if perm == list(range(cat)):
            perm = None
    norm = None
    if hasattr(module, "layer_norm_weight"):
        norm = dict(rms=config.normalization == "RMSNorm", eps=config.layernorm_epsilon,
                    zero_centered=bool(getattr(config, "layernorm_zero_centered_gamma", False)))
    sp = bool(config.sequence_parallel) and not getattr(module, "is_expert", False)
    adapter = LoraAdapter(slices, perm, spec.scaling, dropout, row_parallel, group, sp, norm)
    allreduce = getattr(module.weight, "allreduce", True)
    for a, b in adapter.pairs():
        split, repl = (a, b) if row_parallel else (b, a)
        tensor_parallel.set_tensor_model_parallel_attributes(split, world > 1, 1 if row_parallel else 0, 1)
        repl.sequence_parallel = sp  # gradient partial over the sequence shards: megatron all-reduces it
        for p in (a, b):
            p.allreduce = allreduce  # expert adapters reduce over the expert-data-parallel group, as experts do
    return adapter


def attach_lora(chunks, hf_config: dict, spec: LoraSpec, dropout: float = 0.0, *, te: bool = False,
                divisible_by: int = 128, layout=None, also_train: tuple[str, ...] = ()) -> ModelLayout:
    """Freeze every base parameter of ``chunks`` and attach the adapters of ``spec``; returns the adapter table.

    ``layout``: the training MegatronLayout (default: read from parallel_state). ``also_train``: name prefixes of
    base parameters that stay trainable in full (a VLM's vision tower under model.train_vision: ``("vision.",)``)."""
    from mtrain.reshard.megatron_side import current_layout

    base = model_layout(hf_config, te=te, make_vocab_size_divisible_by=divisible_by, mtp=False)
    adapters = lora_layout(base, spec)
    by_key = base.by_key()
    grouped: dict[str, list[Weight]] = {}
    for w in adapters.weights:
        grouped.setdefault(w.key.split(".lora")[0], []).append(w)
    mlayout = layout or current_layout()
    rank = torch.distributed.get_rank()
    modules = _named_modules(chunks)
    for c in chunks:
        c.requires_grad_(False)
    attached = 0
    for key, rows in grouped.items():
        w = by_key[key]
        for h in mlayout.holders(base, w):
            if h.rank != rank:
                continue
            name = h.name[: -len(".weight")]
            module = modules[h.chunk].get(name)
            if module is None:
                raise LoraError(f"LoRA target {key}: this rank's model has no module {name!r}")
            module.lora = _build_adapter(module, w, rows, h.rule_rank, h.rule_world, spec, dropout,
                                         module.config)
            module.register_forward_hook(_hook)
            module.sharded_state_dict = _lora_sharded_state_dict(module, module.sharded_state_dict)
            attached += 1
    from mtrain.reshard.megatron_side import unwrap
    for c in chunks:  # adapters are the only trainable parameters, beside the also_train ones
        for n, p in unwrap(c).named_parameters():
            p.requires_grad_(".lora." in n or n.startswith(also_train))
    return adapters


def adapter_parameters(chunks) -> dict[str, torch.nn.Parameter]:
    from mtrain.reshard.megatron_side import unwrap
    return {f"chunk{i}.{n}": p for i, c in enumerate(chunks) for n, p in unwrap(c).named_parameters() if ".lora." in n}


def spec_of(cfg) -> LoraSpec | None:
    """The run's LoRA spec (model.lora), or None for full fine-tuning."""
    lo = cfg.model.lora
    return LoraSpec(lo.rank, float(lo.alpha), tuple(lo.targets)) if lo.targets else None
