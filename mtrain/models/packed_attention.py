"""Packed (THD) sequences on megatron-core's local (non-Transformer-Engine) attention.

megatron-core 0.16.1's ``DotProductAttention`` refuses ``packed_seq_params`` ("use TEDotProductAttention").
Everything around it already handles the THD format on its own: ``SelfAttention`` / ``MLASelfAttention``
squeeze the dummy batch dim, RoPE restarts at position 0 for every sequence (``_apply_rotary_pos_emb_thd``,
from ``cu_seqlens``), MoE routes tokens independently. So the only missing piece is the core attention, and
the spec's ``core_attention`` slot is the extension point for it: ``PackedDotProductAttention`` runs causal
attention inside each sequence of the stream (mtrain/models/varlen_attention.py: one varlen flash launch per
layer on a GPU, else torch's fused SDPA per sequence), so attention never crosses a boundary and costs
sum(L_i^2), not S^2 as a block-diagonal mask over the whole stream would. Unpacked calls go to the parent
unchanged. With TE installed, TE's own THD attention is used instead (specs.py). Context parallelism (which
megatron-core's local attention refuses) is done here for packed streams and for padded rows alike: a padded
micro-batch under CP is treated as a packed stream whose sequences are its rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from mtrain.models.tree_attention import tree_attention
from mtrain.models.varlen_attention import causal_packed_attention


def host_cu_seqlens(packed_seq_params) -> list[int]:
    """cu_seqlens as Python ints: the trainer attaches a host copy (no device sync per layer), else read it."""
    host = getattr(packed_seq_params, "mtrain_host_cu_seqlens", None)
    return list(host) if host is not None else packed_seq_params.cu_seqlens_q.tolist()


def device_cu_seqlens(packed_seq_params, device: torch.device) -> torch.Tensor:
    """cu_seqlens (int32) on the attention's device. The trainer may hand megatron-core a host cu_seqlens_q (its
    THD RoPE reads it with .tolist() in every layer: a device sync each time) and attaches the device copy."""
    dev = getattr(packed_seq_params, "mtrain_device_cu_seqlens", None)
    if dev is not None and dev.device == device:
        return dev
    return packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)


class PackedDotProductAttention(DotProductAttention):
    """Local core attention that also takes THD-packed sequences (``qkv_format='thd'`` with ``cu_seqlens``),
    with context parallelism: each CP rank holds chunks r and 2cp-1-r of every sequence (the load-balanced split
    TE uses; RoPE's THD path picks the same positions), gathers every rank's keys and values and attends from its
    own chunks with the causal offset of their global positions."""

    def __init__(self, config, *args, **kwargs):
        # The parent asserts context_parallel_size == 1 ("only TEDotProductAttention"); CP is handled here.
        cp = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def forward(self, query, key, value, attention_mask, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            if self.config.context_parallel_size > 1:
                return self._context_parallel_padded(query, key, value, attention_mask, attn_mask_type,
                                                     attention_bias)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        self._check_packed(packed_seq_params, attention_bias)
        # THD: [t, heads, dim] (SelfAttention squeezed the dummy batch dim)
        query, key, value = (x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        cu = host_cu_seqlens(packed_seq_params)
        # Out as [t, heads, v_dim], as TE's THD attention gives it: SelfAttention and MLASelfAttention flatten it to
        # [t, 1, heads * v_dim] themselves, and megatron-core 0.19's MLA first pads V to the query's head dim for THD
        # and trims the padding off the last axis of this output, which must therefore be per head.
        heads = query.shape[1]
        tree = getattr(packed_seq_params, "mtrain_tree", None)
        if tree is not None:  # train.shared_prefix: continuations attend to their group's prompt (tree_attention.py)
            ctx = tree_attention(query, key, value, tree, self.softmax_scale, groups > 1)
            return ctx.reshape(ctx.shape[0], heads, -1)
        if self.config.context_parallel_size > 1:
            ctx = self._context_parallel(query, key, value, cu, groups)
            return ctx.reshape(ctx.shape[0], heads, -1)
        # One varlen flash launch per layer on a GPU, else fused SDPA per sequence (mtrain/models/varlen_attention.py);
        # scores in float32 either way (the flash kernels keep their accumulators in float32, like the parent's
        # attention_softmax_in_fp32).
        ctx = causal_packed_attention(query, key, value, device_cu_seqlens(packed_seq_params, query.device), cu,
                                      int(packed_seq_params.max_seqlen_q), self.softmax_scale)
        return ctx.reshape(ctx.shape[0], heads, -1)

    def _context_parallel(self, query, key, value, cu: list[int], groups: int) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from mtrain.models.cp_comm import gather_cp
        group = ps.get_context_parallel_group()
        cp, r = self.config.context_parallel_size, ps.get_context_parallel_rank()
        t = query.shape[0]
        k_all = gather_cp(key, group, sum_grads=True)  # [cp * t, groups_kv, dim], rank-major
        v_all = gather_cp(value, group, sum_grads=True)
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            if (b - a) % (2 * cp):
                raise ValueError(f"context parallelism needs every packed sequence padded to a multiple of 2*cp="
                                 f"{2 * cp}, got a segment of {b - a}")
            m, la = (b - a) // (2 * cp), a // cp  # chunk length; this segment's start on every rank
            # the whole sequence in order: chunk c lives on rank c (first half) or 2cp-1-c (second half)
            chunks = [(c, 0) if c < cp else (2 * cp - 1 - c, m) for c in range(2 * cp)]
            k_seq = torch.cat([k_all[j * t + la + off: j * t + la + off + m] for j, off in chunks])
            v_seq = torch.cat([v_all[j * t + la + off: j * t + la + off + m] for j, off in chunks])
            for c, off in ((r, 0), (2 * cp - 1 - r, m)):
                # 4-D [1, heads, len, dim] (torch's fused SDPA kernels take no other shape); GQA without copies
                q = query[la + off: la + off + m].transpose(0, 1).unsqueeze(0)
                n_keys = (c + 1) * m  # causal: global positions up to the end of chunk c
                allowed = (torch.arange(m, device=q.device)[:, None] + c * m
                           >= torch.arange(n_keys, device=q.device)[None, :])
                outs.append(F.scaled_dot_product_attention(q, k_seq[:n_keys].transpose(0, 1).unsqueeze(0),
                                                           v_seq[:n_keys].transpose(0, 1).unsqueeze(0),
                                                           attn_mask=allowed, scale=self.softmax_scale,
                                                           enable_gqa=groups > 1)[0])
        ctx = torch.cat(outs, dim=1)
        return ctx.transpose(0, 1).reshape(t, 1, -1)

    def _context_parallel_padded(self, query, key, value, attention_mask, attn_mask_type, attention_bias):
        """Padded rows ([s, b, heads, dim], s = this CP rank's two chunks of every row, as megatron-core's RoPE
        assumes for unpacked input) under CP: each row is one sequence of the global width cp * s, so laid out
        row-major it is a packed stream with segment boundaries at multiples of the width, and the packed CP
        attention applies as it is. Right padding sits at the end of each row: causal attention keeps it out of
        every real position."""
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        extras = attention_bias is not None or self.softmax_offset is not None or self.config.window_size is not None
        if mask_type != AttnMaskType.causal or extras:
            raise ValueError(f"context parallelism on the local attention supports plain causal attention only "
                             f"(mask type {mask_type.name}; attention bias, sinks or a sliding window set: {extras})")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("context parallelism on the local attention: attention dropout is not supported")
        s, b = query.shape[:2]
        rows = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value)]
        width = s * self.config.context_parallel_size
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        ctx = self._context_parallel(*rows, list(range(0, b * width + 1, width)), groups)  # [b*s, 1, h*d]
        return ctx.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _check_packed(self, params, attention_bias) -> None:
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences on the local attention need qkv_format='thd', got {params.qkv_format!r}")
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise ValueError("packed sequences on the local attention: cu_seqlens_*_padded is not supported "
                             "(mtrain packs without per-sequence padding)")
        if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q \
                and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if attention_bias is not None or self.softmax_offset is not None or self.config.window_size is not None:
            raise ValueError("packed sequences on the local attention: attention bias, softmax offsets (sinks) and "
                             "sliding windows are not supported")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("packed sequences on the local attention: attention dropout is not supported")
