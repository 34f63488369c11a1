"""Causal attention over a shared-prefix packed stream (train.shared_prefix, docs/design-shared-prefix.md).

The stream holds, per GRPO group, the prompt once and then each sample's own continuation (mtrain/trainer/
prefix_tree.py). A query segment is described by (q_start, q_len, prefix_start, prefix_len): its queries attend to
the prefix [prefix_start, prefix_start + prefix_len) and causally to their own segment, the segment's token j
sitting at position prefix_len + j of its sequence. prefix_len = 0 is an ordinary packed sequence. Each sample then
sees exactly the keys and values it would see unshared (the prefix's are the same numbers: computed once from the
same tokens and positions), so its outputs are the unshared ones, and the prefix's gradient is the sum of what each
sample sends back to it, as in the unshared computation.

Per segment one fused SDPA call on 4-D views (GQA without copying K/V), keys = the prefix's and the segment's
(a [q_len, prefix_len + q_len] bottom-right causal mask). On a GPU a varlen kernel with separate query and key
boundaries would take the whole stream in one launch; not built yet (this loop is correct there, slower).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Segment = tuple[int, int, int, int]  # (q_start, q_len, prefix_start, prefix_len)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: list[Segment],
                   scale: float | None, gqa: bool) -> torch.Tensor:
    """query/key/value [t, heads, dim] of the stream; segments tile [0, t) in order. Returns [t, heads, v_dim]."""
    outs = []
    for q0, n, p0, plen in segments:
        q = query[q0:q0 + n].transpose(0, 1).unsqueeze(0)
        if plen:
            k = torch.cat([key[p0:p0 + plen], key[q0:q0 + n]])
            v = torch.cat([value[p0:p0 + plen], value[q0:q0 + n]])
            allowed = (torch.arange(n, device=q.device)[:, None] + plen
                       >= torch.arange(plen + n, device=q.device)[None, :])
            out = F.scaled_dot_product_attention(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 attn_mask=allowed, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, key[q0:q0 + n].transpose(0, 1).unsqueeze(0),
                                                 value[q0:q0 + n].transpose(0, 1).unsqueeze(0), is_causal=True,
                                                 scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
