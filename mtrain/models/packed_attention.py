"""Packed (THD) sequences on megatron-core's local (non-Transformer-Engine) attention.

megatron-core 0.16.1's ``DotProductAttention`` refuses ``packed_seq_params`` ("use TEDotProductAttention").
Everything around it already handles the THD format on its own: ``SelfAttention`` / ``MLASelfAttention``
squeeze the dummy batch dim, RoPE restarts at position 0 for every sequence (``_apply_rotary_pos_emb_thd``,
from ``cu_seqlens``), MoE routes tokens independently. So the only missing piece is the core attention, and
the spec's ``core_attention`` slot is the extension point for it: ``PackedDotProductAttention`` runs causal
attention on each sequence of the stream on its own (torch's ``scaled_dot_product_attention``: flash or
memory-efficient kernels on a GPU), so attention never crosses a boundary and costs sum(L_i^2), not S^2 as a
block-diagonal mask over the whole stream would. Unpacked calls go to the parent unchanged. With TE installed,
TE's own THD attention is used instead (specs.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def host_cu_seqlens(packed_seq_params) -> list[int]:
    """cu_seqlens as Python ints: the trainer attaches a host copy (no device sync per layer), else read it."""
    host = getattr(packed_seq_params, "mtrain_host_cu_seqlens", None)
    return list(host) if host is not None else packed_seq_params.cu_seqlens_q.tolist()


class PackedDotProductAttention(DotProductAttention):
    """Local core attention that also takes THD-packed sequences (``qkv_format='thd'`` with ``cu_seqlens``)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        self._check_packed(packed_seq_params, attention_bias)
        # THD: [t, heads, dim] (SelfAttention squeezed the dummy batch dim) -> [heads, t, dim]
        query, key, value = (x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        cu = host_cu_seqlens(packed_seq_params)
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            # Scores in float32 like the parent's softmax (attention_softmax_in_fp32); on a GPU in bf16 the
            # flash kernel keeps its accumulators in float32 as well.
            outs.append(F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                       scale=self.softmax_scale))
        ctx = torch.cat(outs, dim=1)  # [heads, t, v_dim]
        return ctx.transpose(0, 1).reshape(ctx.shape[1], 1, -1)  # [t, 1, heads * v_dim], as SelfAttention expects

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
