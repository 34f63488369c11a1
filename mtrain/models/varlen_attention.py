"""Causal attention over a THD-packed stream: one kernel launch per layer where torch has one, else one
fused SDPA launch per sequence.

Why (issue 18, H200 run of 2026-11-30): the packed path called ``scaled_dot_product_attention`` on 3-D
[heads, L, dim] slices. Torch's fused kernels (flash, memory-efficient, cuDNN) accept only 4-D inputs
(``check_tensor_shapes``), so every call fell back to the *math* backend: the full L x L score matrix,
materialised, in float32 for bf16 inputs, forward and backward, per sequence and layer, after a
``repeat_interleave`` copy of K and V for GQA. Packed throughput sat at 0.60 of the fixed-length ceiling.

- ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9; flash attention over ``cu_seqlens``): the whole
  stream in one launch, GQA without copies where the installed version takes ``enable_gqa``. Used on CUDA in
  fp16/bf16 with a head size flash supports. Its keyword arguments moved between releases (2.9/2.10:
  ``is_causal``; 2.11+: ``window_size=(-1, 0)``, ``scale``, ``enable_gqa``), so they are read from its signature.
- Otherwise (CPU, float32, older torch): per sequence, 4-D [1, heads, L, dim] views so a fused kernel can
  run, and ``enable_gqa=True`` instead of copying K/V.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
from functools import lru_cache
from typing import Callable, Optional

import torch
import torch.nn.functional as F


log = logging.getLogger(__name__)
# Which path ran ("varlen", "sdpa_per_sequence") and, if the varlen kernel raised, its error (then this process
# stays on the per-sequence path): read by benchmarks/bench_train_throughput.py so a run says what it measured.
PATHS_USED: set[str] = set()
VARLEN_ERROR: list[str] = []


@lru_cache(maxsize=1)
def _varlen() -> Optional[tuple[Callable, frozenset]]:
    """(varlen_attn, names of its parameters), or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    try:
        names = frozenset(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        return None
    if "window_size" not in names and "is_causal" not in names:
        return None  # no way to ask for causal attention: unknown API, do not guess
    return varlen_attn, names


def varlen_usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `varlen_attn` can take these [t, heads, dim] tensors: CUDA, half precision, a flash head size.
    MTRAIN_VARLEN_ATTN=0 forces the per-sequence path (for comparing the two on a GPU)."""
    if os.environ.get("MTRAIN_VARLEN_ATTN", "1") == "0" or VARLEN_ERROR or _varlen() is None:
        return False
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return False
    d_qk, d_v = query.shape[-1], value.shape[-1]
    return d_qk == d_v and d_qk % 8 == 0 and d_qk <= 256


def causal_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_device: torch.Tensor,
                            cu_host: list[int], max_seqlen: int, scale: float) -> torch.Tensor:
    """query [t, hq, d], key/value [t, hkv, d(v)] (hq a multiple of hkv), segments cu (int32 on the device and the
    same values as Python ints): causal attention inside each segment -> [t, hq, dv]."""
    groups = query.shape[1] // key.shape[1]
    if varlen_usable(query, key, value):
        fn, names = _varlen()
        kwargs = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
        q = query
        if "scale" in names:
            kwargs["scale"] = scale
        elif not math.isclose(scale, query.shape[-1] ** -0.5, rel_tol=1e-6):
            q = query * (scale * query.shape[-1] ** 0.5)  # the kernel applies 1/sqrt(d): fold the rest into q
        k, v = key, value
        if groups > 1:
            if "enable_gqa" in names:
                kwargs["enable_gqa"] = True
            else:
                k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        try:
            out = fn(q, k, v, cu_device, cu_device, max_seqlen, max_seqlen, **kwargs)
        except (RuntimeError, TypeError, ValueError) as e:  # e.g. a GPU or head size its flash build lacks
            VARLEN_ERROR.append(f"{type(e).__name__}: {e}")
            log.warning("torch varlen_attn failed (%s); this process uses per-sequence SDPA from now on",
                        VARLEN_ERROR[-1])
        else:
            PATHS_USED.add("varlen")
            return out
    PATHS_USED.add("sdpa_per_sequence")
    # [t, h, d] -> [1, h, t, d]: a view; slices along t stay 4-D, which the fused SDPA kernels need
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
                                           enable_gqa=groups > 1)
            for a, b in zip(cu_host[:-1], cu_host[1:])]
    return torch.cat(outs, dim=2)[0].transpose(0, 1)  # [t, hq, dv]
