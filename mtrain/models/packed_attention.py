"""Packed (THD) sequences on megatron-core's local (non-Transformer-Engine) attention.

megatron-core 0.16.1's ``DotProductAttention`` refuses ``packed_seq_params`` ("use TEDotProductAttention").
Everything around it already handles the THD format on its own: ``SelfAttention`` / ``MLASelfAttention``
squeeze the dummy batch dim, RoPE restarts at position 0 for every sequence (``_apply_rotary_pos_emb_thd``,
from ``cu_seqlens``), MoE routes tokens independently. So the only missing piece is the core attention, and
the spec's ``core_attention`` slot is the extension point for it: ``PackedDotProductAttention`` turns
``cu_seqlens`` into a block-diagonal causal mask (a token attends to earlier tokens of its own sequence only)
and runs the parent's math on it. With TE installed, TE's own THD attention is used instead (specs.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, 1, total, total] bool, True where attention is *masked* (Megatron's convention): a different
    sequence, or a later position. Positions past cu_seqlens[-1] form one more sequence of their own."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens[1:].to(pos.dtype), pos, right=True)
    masked = (seg[:, None] != seg[None, :]) | (pos[None, :] > pos[:, None])
    return masked[None, None]


class PackedDotProductAttention(DotProductAttention):
    """Local core attention that also takes THD-packed sequences (``qkv_format='thd'`` with ``cu_seqlens``)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences on the local attention need qkv_format='thd', "
                             f"got {packed_seq_params.qkv_format!r}")
        if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
            raise ValueError("packed sequences on the local attention: cu_seqlens_*_padded is not supported "
                             "(mtrain packs without per-sequence padding)")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_q, cu_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        # SelfAttention squeezed the dummy batch dim for THD: [t, heads, dim] -> [t, 1, heads, dim].
        query, key, value = (x.unsqueeze(1) if x.dim() == 3 else x for x in (query, key, value))
        mask = block_causal_mask(cu_q, query.shape[0])
        softmax = self.scale_mask_softmax
        # A causal mask type would make the fused softmax kernel (GPU, fp16/bf16) ignore our mask and apply its
        # own upper-triangular one across sequence boundaries; the padding type uses the mask given.
        saved = softmax.attn_mask_type
        softmax.attn_mask_type = AttnMaskType.padding
        try:
            out = super().forward(query, key, value, mask, attn_mask_type=AttnMaskType.padding,
                                  attention_bias=attention_bias)
        finally:
            softmax.attn_mask_type = saved
        return out  # [t, 1, heads * v_dim]: SelfAttention reshapes THD output to exactly this
