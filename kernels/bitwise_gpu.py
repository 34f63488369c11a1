"""GPU forms of the bitwise on-policy ops whose result a GPU library would make depend on the batch (Triton).

Why: on a GPU the trainer (Megatron) and the engine (SGLang, in process) run the same model on different shapes: the
engine decodes one row per request and prefills prompts in chunks, the trainer runs packed sequences of thousands of
tokens. cuBLAS picks its algorithm, tiling and split-K by shape, and attention kernels split the keys by batch size,
so the same token's logprob differs in its low bits between the two sides. The kernels here fix every choice:

- `linear`: one tile shape for every call (BLOCK_M x BLOCK_N, K in BLOCK_K chunks added in ascending order into a
  float32 accumulator, the same tensor-core instruction). An output element depends only on its own row of x, its
  own row of the weight and those constants: not on how many rows the call has, nor on where the row or the column
  sits in its tile. Rows and K past the end are loaded as exact zeros.
- `paged_attention`: one program per (query token, KV head), whose keys are read through an index table (the
  engine's req_to_token rows; for the trainer, a table of its packed sequences). A query's keys 0..pos are visited
  in BLOCK_N blocks from position 0 with the online softmax; keys past pos are loaded as zeros and masked to -inf.
  So a query gives the same bits in a decode step, in a prefill chunk with or without a cached prefix, and in the
  trainer's full sequence.

- `rms_norm`: one program per row and one reduction tree over the row's power-of-two block, in one launch (the CPU
  form's tree of torch additions is the same bits on a GPU too, at a dozen launches per norm).

The other bitwise ops (RoPE, SiLU, elementwise IEEE arithmetic) are already the same bits on a GPU whatever the
shape: CUDA elementwise kernels apply one per-element function, vectorised or not.

Backward passes (the trainer) use cuBLAS, torch's RMSNorm formula and (mtrain/models/bitwise_layers.py) the varlen
flash attention on the saved inputs: the gradient needs no bitwise agreement.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# One tile for every linear: changing it changes the bits on both sides. 128 x 128 x 64, 4 warps, 3 stages: of the
# eight tiles benchmarks/gpu_bitwise_check.py --tiles timed on an H100 (2026-12-07, docs/results.md), the fastest on
# Qwen3-1.7B's layer shapes and head (1.27-1.41x cuBLAS at 4,096 rows, where 64 x 128 x 64 took 1.76-1.89x) and
# level with it on SmolLM2's (1.59-1.87x); every candidate kept a row's bits in any batch.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
LINEAR_WARPS, LINEAR_STAGES = 4, 3
LINEAR_GROUP_M = 8  # launch order only (tiles of GROUP_M row blocks share a column block in L2): never the bits
ATTN_BLOCK_N = 64  # keys per block of the online softmax
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: a KV group's query heads are padded to this


# M (rows) is not specialised: one compiled kernel for every batch, and no recompilation per row count. N and K
# (a layer's shape) are, and EVEN_K drops the K mask: both only change how the tiles are loaded, not the arithmetic.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
                   EVEN_K: tl.constexpr):
    # One program per output tile, numbered so that GROUP_M consecutive programs walk down GROUP_M row blocks of
    # one column block before the next column: the weight tile and the rows stay in L2 between neighbours. Which
    # program computes a tile never changes the tile's arithmetic.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_K:
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=rm[:, None] < M, other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=rn[None, :] < N, other=0.0)
        else:
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
        if IEEE:  # float32 models: no TF32 rounding of the inputs
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


LINEAR_TILE = (BLOCK_M, BLOCK_N, BLOCK_K, LINEAR_WARPS, LINEAR_STAGES, LINEAR_GROUP_M)


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                    tile: tuple[int, int, int, int, int, int] = LINEAR_TILE) -> torch.Tensor:
    """tile: (BM, BN, BK, warps, stages, group_m). Every caller of the mode uses LINEAR_TILE; another tile is for
    measuring candidates (benchmarks/gpu_bitwise_check.py), since a change of tile changes the bits on both sides."""
    bm, bn, bk, warps, stages, group_m = tile
    k = x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    out = torch.empty(flat.shape[0], n, device=x.device, dtype=out_dtype)
    if flat.shape[0] and n:
        grid = (triton.cdiv(flat.shape[0], bm) * triton.cdiv(n, bn),)
        _linear_kernel[grid](flat, w, out, flat.shape[0], n, k, flat.stride(0), flat.stride(1), w.stride(0),
                             w.stride(1), out.stride(0), out.stride(1), BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                             IEEE=x.dtype == torch.float32, EVEN_K=k % bk == 0, num_warps=warps, num_stages=stages)
    return out.reshape(*x.shape[:-1], n)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        ctx.save_for_backward(x, weight)
        return _linear_forward(x, weight, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (g.to(weight.dtype) @ weight).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t().to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        return gx, gw, None


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T with float32 output (the accumulator, not rounded). Differentiable."""
    return _Linear.apply(x, weight, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product rounded once to x's dtype. Differentiable."""
    return _Linear.apply(x, weight, x.dtype)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / D  # one reduction tree per BLOCK: the same for every row and every row count
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = w * (x / tl.sqrt_rn(var + eps))
    tl.store(out_ptr + row * D + d, y.to(out_ptr.dtype.element_ty), mask=d < D)


def _rms_norm_reference(x, weight, eps):
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        d = x.shape[-1]
        flat = x.reshape(-1, d).contiguous()
        out = torch.empty_like(flat)
        if flat.shape[0]:
            _rms_norm_kernel[(flat.shape[0],)](flat, weight.contiguous(), out, flat.shape[0], d, float(eps),
                                               BLOCK=triton.next_power_of_2(d), num_warps=4)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_rms_norm_reference(xs, ws, ctx.eps), (xs, ws), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, float32 inside, one launch, rounded to x's dtype.
    Differentiable (backward: torch's formula on the saved input)."""
    return _RmsNorm.apply(x, weight, float(eps))


@triton.jit(do_not_specialize=["n_tokens"])
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, row_ptr, pos_ptr, table_ptr, n_tokens,
                            sqt, sqh, skt, skh, svt, svh, sot, soh, s_table, scale,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                            IEEE: tl.constexpr):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = hk * G + g
    q = tl.load(q_ptr + t * sqt + heads[:, None] * sqh + d[None, :], mask=g[:, None] < G, other=0.0)
    m = tl.full((GP,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, D), dtype=tl.float32)
    n_keys = pos + 1
    for n0 in range(0, n_keys, BN):
        offs = n0 + tl.arange(0, BN)
        valid = offs < n_keys
        slot = tl.load(table_ptr + row * s_table + offs, mask=valid, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * skt + hk * skh + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * svt + hk * svh + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:  # float32 models: no TF32 rounding of the inputs
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / denom[:, None]
    tl.store(o_ptr + t * sot + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=g[:, None] < G)


def _attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The attention kernels' inputs checked (whole query groups per KV head, a power-of-two head dim >= 16) and made
    contiguous in the head dim; returns them and the group size."""
    h, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    group = h // hkv
    if h != group * hkv or d & (d - 1) or d < 16:
        raise ValueError(f"bitwise attention: {h} query heads over {hkv} KV heads of dim {d} (needs a whole group "
                         f"per KV head and a power-of-two head dim >= 16)")
    k_cache, v_cache = (c if c.stride(-1) == 1 else c.contiguous() for c in (k_cache, v_cache))
    return (q if q.stride(-1) == 1 else q.contiguous()), k_cache, v_cache, group


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each query token over keys 0..position of its table row.

    q [T, H, D]; k_cache, v_cache [slots, Hkv, D] (H a multiple of Hkv); table [R, L] slot ids; rows, positions [T]
    (the token's table row and its position). Returns [T, H, D] in q's dtype. Forward only (no autograd)."""
    q, k_cache, v_cache, group = _attention_inputs(q, k_cache, v_cache)
    t, hkv, d = q.shape[0], k_cache.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if t:
        gp = max(MIN_DOT_ROWS, triton.next_power_of_2(group))
        _paged_attention_kernel[(t, hkv)](
            q, k_cache, v_cache, out, rows, positions, table, t,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), table.stride(0), float(scale), G=group, GP=gp, D=d, BN=ATTN_BLOCK_N,
            IEEE=q.dtype == torch.float32, num_warps=4)
    return out


# `segment_attention` reads each key block once for up to SEGMENT_TOKENS query tokens of one sequence, where
# `paged_attention` reads it once per token (the trainer's packed sequences and the engine's prefill re-read every
# key per query: 3.8x SDPA's forward time at head dim 128). Equal bits need one kernel with one tile on both sides
# and every path (decode, prefill, chunk, packed) through it, so the mode runs one of the two everywhere:
# ATTENTION, "segment": benchmarks/gpu_bitwise_check.py showed its prefill, chunk-over-prefix and decode paths equal
# to the trainer's packed sequences on an H100's compiled code (head dims 64 and 128), at 0.51x / 0.56x SDPA's
# forward time where paged_attention took 0.70x / 2.62x (2026-12-07, docs/results.md). MTRAIN_BITWISE_ATTENTION=token
# selects paged_attention (benchmarks/gpu_bitwise.sh ATTN=token); SGLang's scheduler processes inherit the
# variable, so both sides agree.
SEGMENT_TOKENS = 16
ATTENTION = os.environ.get("MTRAIN_BITWISE_ATTENTION", "segment")
if ATTENTION not in ("token", "segment"):
    raise ValueError(f"MTRAIN_BITWISE_ATTENTION must be token or segment, got {ATTENTION!r}")


@triton.jit(do_not_specialize=["n_segments"])
def _segment_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seg_start_ptr, seg_len_ptr, row_ptr, pos_ptr, table_ptr,
                              n_segments, sqt, sqh, skt, skh, svt, svh, sot, soh, s_table, scale,
                              G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                              BN: tl.constexpr, IEEE: tl.constexpr):
    seg = tl.program_id(0)
    hk = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    count = tl.load(seg_len_ptr + seg)
    r = tl.arange(0, BT * GP)  # tile row = (token of the segment, query head of this KV head's group)
    ti = r // GP
    gi = r % GP
    live = (ti < count) & (gi < G)
    tok = start + ti
    pos = tl.load(pos_ptr + tok, mask=ti < count, other=-1).to(tl.int64)
    row = tl.load(row_ptr + start).to(tl.int64)  # every token of a segment is of one sequence
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * sqt + (hk * G + gi)[:, None] * sqh + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full((BT * GP,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BT * GP,), dtype=tl.float32)
    acc = tl.zeros((BT * GP, D), dtype=tl.float32)
    n_keys = tl.max(pos, 0) + 1
    for n0 in range(0, n_keys, BN):
        offs = n0 + tl.arange(0, BN)
        inside = offs < n_keys
        slot = tl.load(table_ptr + row * s_table + offs, mask=inside, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * skt + hk * skh + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * svt + hk * svh + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(offs[None, :] <= pos[:, None], s, float("-inf"))
        # A row past its last key block keeps its state untouched, so each row sees exactly the blocks 0..pos // BN
        # whatever the other tokens of its segment (a row with no key yet would otherwise compute exp(-inf + inf)).
        active = n0 <= pos
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        if IEEE:
            acc_new = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        denom = tl.where(active, denom * alpha + tl.sum(p, 1), denom)
        acc = tl.where(active[:, None], acc_new, acc)
        m = tl.where(active, m_new, m)
    out = acc / denom[:, None]
    tl.store(o_ptr + tok[:, None] * sot + (hk * G + gi)[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=live[:, None])


def sequence_segments(starts: list[int], lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token, token count) of each segment: every sequence's tokens [start, start + length) cut into runs of
    at most SEGMENT_TOKENS (a decode step: one segment per token)."""
    first, count = [], []
    for a, n in zip(starts, lengths):
        for j in range(0, n, SEGMENT_TOKENS):
            first.append(a + j)
            count.append(min(SEGMENT_TOKENS, n - j))
    return (torch.tensor(first, dtype=torch.int32).to(device), torch.tensor(count, dtype=torch.int32).to(device))


def segment_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`paged_attention`'s result, one program per (segment, KV head): seg_start / seg_len ([S] int32) cut the
    tokens into runs of one sequence (`sequence_segments`), ascending positions. Forward only."""
    q, k_cache, v_cache, group = _attention_inputs(q, k_cache, v_cache)
    t, hkv, d = q.shape[0], k_cache.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if t and seg_start.numel():
        gp = triton.next_power_of_2(group)
        bt = max(SEGMENT_TOKENS, MIN_DOT_ROWS // gp)
        _segment_attention_kernel[(seg_start.numel(), hkv)](
            q, k_cache, v_cache, out, seg_start, seg_len, rows, positions, table, seg_start.numel(),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), table.stride(0), float(scale), G=group, GP=gp, BT=bt, D=d,
            BN=ATTN_BLOCK_N, IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def packed_tables(cu_seqlens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table, rows, positions) of packed sequences [cu[i], cu[i+1]): row i lists the packed offsets of sequence i.
    Kept for the last few layouts: every layer of a micro-batch asks for the same one."""
    return _packed_tables(tuple(int(c) for c in cu_seqlens), torch.device(device))


@functools.lru_cache(maxsize=8)
def _packed_tables(cu_seqlens: tuple[int, ...], device: torch.device):
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    width = max(lengths, default=1) or 1
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.int64)
    table = (starts[:, None] + torch.arange(width)[None, :]).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
    return table.to(device), rows.to(device=device, dtype=torch.int32), positions.to(device=device, dtype=torch.int32)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
              rows: torch.Tensor, positions: torch.Tensor, scale: float, segments=None) -> torch.Tensor:
    """The mode's attention on both sides: `paged_attention`, or `segment_attention` when ATTENTION is "segment"
    (segments: (seg_start, seg_len), required then; callers build them only in that case)."""
    if ATTENTION == "segment":
        if segments is None:
            raise ValueError("bitwise_gpu.attention: the segment kernel needs the caller's (seg_start, seg_len)")
        return segment_attention(q, k_cache, v_cache, table, rows, positions, *segments, scale)
    return paged_attention(q, k_cache, v_cache, table, rows, positions, scale)


def packed_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                           scale: float) -> torch.Tensor:
    """The mode's attention over packed sequences (q [T, H, D], k and v [T, Hkv, D], host cu_seqlens): the trainer's
    forward (its autograd is mtrain.models.bitwise_layers' engine attention). Forward only."""
    table, rows, positions = packed_tables(cu_seqlens, q.device)
    segments = _packed_segments(tuple(int(c) for c in cu_seqlens), q.device) if ATTENTION == "segment" else None
    return attention(q, k, v, table, rows, positions, scale, segments)


@functools.lru_cache(maxsize=8)
def _packed_segments(cu_seqlens: tuple[int, ...], device: torch.device):
    return sequence_segments(list(cu_seqlens[:-1]), [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], device)


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The sampled token's logprob as SGLang 0.5.17's sampler returns it (layers/sampler.py, the standard path):
    float32 logits divided by a temperature *tensor* (a CUDA tensor-by-scalar division is a multiplication by the
    reciprocal, another rounding), softmax, log; greedy (temperature 0) takes log_softmax. Differentiable."""
    x = logits.float()
    flat = x.reshape(-1, x.shape[-1])
    if temperature == 0:
        logp = torch.log_softmax(flat, dim=-1)
    else:
        temps = torch.full((flat.shape[0], 1), float(temperature), device=flat.device, dtype=torch.float32)
        logp = torch.log(torch.softmax(flat / temps, dim=-1))
    return logp.gather(-1, target.reshape(-1, 1).long()).reshape(target.shape)
