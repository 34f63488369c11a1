"""The GPU bitwise kernels (kernels/bitwise_gpu.py) in Triton's interpreter: the engine's ways of reaching a token
(prefill, chunked prefill over a cached prefix, one decode step at a time, through a scattered KV cache) give the same
bits as the trainer's packed sequences, and each is right against float64 math written from the formulas.

The interpreter runs the kernels' logic (tiling, masks, index tables, online softmax) with NumPy arithmetic, in float32
(it has no bf16 matrix product); the same checks in bf16 on the GPU's compiled kernels are in
benchmarks/gpu_bitwise_check.py."""
from __future__ import annotations

import math
import os

import pytest
import torch

from mtrain.kernels import bitwise_gpu as g


def _ref_attention(q, k, v, scale):
    """float64 causal attention of one sequence, grouped-query."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", qd, kd) * scale
    t = q.shape[0]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), vd)


def _packed_qkv(gen, heads: int, kv_heads: int, dim: int):
    """float32 q, k, v of three packed sequences (the first spans two key blocks), their lengths and cu_seqlens."""
    lengths = [70, 5, 33]
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen).float()
    k = torch.randn(total, kv_heads, dim, generator=gen).float()
    v = torch.randn(total, kv_heads, dim, generator=gen).float()
    return q, k, v, lengths, [0] + list(itertools_accumulate(lengths))


def _cached_sequence(k, v, gen):
    """One sequence's keys and values in a KV cache of 300 slots, at scattered slots listed by row 2 of a
    req_to_token-like table: (k_cache, v_cache, table)."""
    n = k.shape[0]
    slots = torch.randperm(300, generator=gen)[:n]
    k_cache = torch.zeros(300, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots], v_cache[slots] = k, v
    table = torch.zeros(4, 128, dtype=torch.int32)
    table[2, :n] = slots.to(torch.int32)  # the request's row of req_to_token
    return k_cache, v_cache, table


def test_linear_rows_do_not_depend_on_the_batch():
    dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=gen).to(dtype)  # K = 96: one full and one partial K block
    w = torch.randn(40, 96, generator=gen).to(dtype)
    full = g.linear_fp32(x, w)
    for lo, hi in ((0, 1), (5, 6), (64, 70), (3, 67)):
        assert torch.equal(g.linear_fp32(x[lo:hi], w), full[lo:hi]), (lo, hi)
    # a column computed inside another tile of the weight (the trainer's fused QKV orders columns differently)
    assert torch.equal(g.linear_fp32(x, w[7:33]), full[:, 7:33])
    ref = x.double() @ w.double().t()
    assert (full.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert g.linear(x, w).dtype == dtype and torch.equal(g.linear(x, w), full.to(dtype))


def test_linear_launch_order_reaches_every_tile_once():
    """The grouped launch order (GROUP_M row blocks per column block, a partial last group): every output tile is
    written, at its place, whatever the group size; the bits do not depend on it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 48, generator=gen)  # 5 row blocks of 16 (the last partial), 4 column blocks of 16
    w = torch.randn(50, 48, generator=gen)
    ref = x.double() @ w.double().t()
    outs = [g._linear_forward(x, w, torch.float32, (16, 16, 16, 4, 1, group)) for group in (1, 2, 3, 8)]
    assert (outs[0].double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_linear_backward_is_the_matmul_gradient():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=gen, requires_grad=True)
    w = torch.randn(16, 32, generator=gen, requires_grad=True)
    gy = torch.randn(9, 16, generator=gen)
    g.linear_fp32(x, w).backward(gy)
    assert torch.allclose(x.grad, gy @ w.detach(), atol=1e-5)
    assert torch.allclose(w.grad, gy.t() @ x.detach(), atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (3, 1, 32)])
def test_attention_engine_paths_equal_the_trainers_packed_sequence(heads, kv_heads, dim, monkeypatch):
    """paged_attention (MTRAIN_BITWISE_ATTENTION=token): the trainer's packed sequences and the engine's paths."""
    monkeypatch.setattr(g, "ATTENTION", "token")
    gen = torch.Generator().manual_seed(2)
    q, k, v, lengths, cu = _packed_qkv(gen, heads, kv_heads, dim)
    scale = dim ** -0.5
    trainer = g.packed_paged_attention(q, k, v, cu, scale)  # the trainer's forward
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        ref = _ref_attention(q[a:b], k[a:b], v[a:b], scale)
        assert (trainer[a:b].double() - ref).abs().max() < 1e-5, i

    # The engine: sequence 0 in a KV cache at scattered slots, reached by a prefill of 40 tokens, a chunk of 20
    # over that cached prefix, then one decode step per token.
    n = lengths[0]
    k_cache, v_cache, table = _cached_sequence(k[:n], v[:n], gen)
    pieces = [(0, 40), (40, 60)] + [(p, p + 1) for p in range(60, n)]
    for a, b in pieces:
        rows = torch.full((b - a,), 2, dtype=torch.int32)
        pos = torch.arange(a, b, dtype=torch.int32)
        out = g.paged_attention(q[a:b], k_cache, v_cache, table, rows, pos, scale)
        assert torch.equal(out, trainer[a:b]), (a, b)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (3, 1, 32)])
def test_segment_attention_paths_are_equal_and_right(heads, kv_heads, dim):
    """The candidate `segment_attention`: several tokens of a sequence per program. The trainer's packed sequences
    (segments of up to SEGMENT_TOKENS), a prefill, a chunk over a cached prefix and single decode steps give one
    another's bits, and float64 attention's values."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, lengths, cu = _packed_qkv(gen, heads, kv_heads, dim)
    scale = dim ** -0.5
    table, rows, pos = g.packed_tables(cu, "cpu")
    seg_start, seg_len = g.sequence_segments(cu[:-1], lengths, "cpu")
    trainer = g.segment_attention(q, k, v, table, rows, pos, seg_start, seg_len, scale)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        assert (trainer[a:b].double() - _ref_attention(q[a:b], k[a:b], v[a:b], scale)).abs().max() < 1e-5, i
    n = lengths[0]
    k_cache, v_cache, cache_table = _cached_sequence(k[:n], v[:n], gen)
    # a prefill of 37 tokens (segments of 16, 16, 5), a chunk of 20 over it, then decode steps
    for a, b in [(0, 37), (37, 57)] + [(p, p + 1) for p in range(57, n)]:
        starts, counts = g.sequence_segments([0], [b - a], "cpu")
        out = g.segment_attention(q[a:b], k_cache, v_cache, cache_table, torch.full((b - a,), 2, dtype=torch.int32),
                                  torch.arange(a, b, dtype=torch.int32), starts, counts, scale)
        assert torch.equal(out, trainer[a:b]), (a, b)


def test_the_modes_attention_is_one_kernel_on_both_sides(monkeypatch):
    """bitwise_gpu.ATTENTION picks the kernel of every path: with "segment" (the default) the trainer's packed
    attention is segment_attention's, and `attention` refuses to run it without the caller's segments."""
    assert g.ATTENTION == "segment" or os.environ.get("MTRAIN_BITWISE_ATTENTION")
    monkeypatch.setattr(g, "ATTENTION", "token")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(21, h, 16, generator=gen) for h in (4, 2, 2))
    cu = [0, 17, 21]
    table, rows, pos = g.packed_tables(cu, "cpu")
    token = g.packed_paged_attention(q, k, v, cu, 0.25)
    assert torch.equal(token, g.paged_attention(q, k, v, table, rows, pos, 0.25))
    monkeypatch.setattr(g, "ATTENTION", "segment")
    seg = g.packed_paged_attention(q, k, v, cu, 0.25)
    assert torch.equal(seg, g.segment_attention(q, k, v, table, rows, pos, *g.sequence_segments([0, 17], [17, 4], "cpu"),
                                                0.25))
    assert (seg - token).abs().max() < 1e-5
    with pytest.raises(ValueError, match="segment kernel needs"):
        g.attention(q, k, v, table, rows, pos, 0.25)


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def test_trainers_attention_backward_is_the_attention_gradient():
    """The trainer's bitwise attention (the engine's kernel forward, a recomputed backward) against the gradient of
    float64 attention written from the formula."""
    from mtrain.models.bitwise_layers import _EngineAttention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(12, 2, 16, generator=gen, requires_grad=True)
    v = torch.randn(12, 2, 16, generator=gen, requires_grad=True)
    gy = torch.randn(12, 4, 16, generator=gen)
    _EngineAttention.apply(q, k, v, [0, 7, 12], 0.25).backward(gy)
    grads = [t.grad.clone() for t in (q, k, v)]
    ref_grads = []
    for t in (q, k, v):
        t.grad = None
    out = torch.cat([_ref_attention(q[a:b], k[a:b], v[a:b], 0.25) for a, b in ((0, 7), (7, 12))]).float()
    out.backward(gy)
    ref_grads = [t.grad for t in (q, k, v)]
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_sampler_logprobs_follow_sglangs_formula():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 50, generator=gen, dtype=torch.float64).float()
    target = torch.tensor([0, 3, 49, 7, 7])
    for t in (1.0, 0.7):
        got = g.token_logprobs(logits, target, t)
        ref = torch.log_softmax(logits.double() / t, -1).gather(-1, target[:, None])[:, 0]
        assert (got.double() - ref).abs().max() < 1e-5
    greedy = g.token_logprobs(logits, target, 0)
    assert torch.equal(greedy, torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0])
    assert not math.isnan(float(greedy.sum()))


def test_rms_norm_rows_do_not_depend_on_the_batch_and_match_float64():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 96, generator=gen, requires_grad=True)  # 96: a row shorter than its power-of-two block
    w = torch.randn(96, generator=gen, requires_grad=True)
    full = g.rms_norm(x, w, 1e-6)
    assert torch.equal(g.rms_norm(x[5:6], w, 1e-6), full[5:6])
    assert torch.equal(g.rms_norm(x[:, None, :], w, 1e-6)[:, 0], full)  # per-head rows (Qwen3's q/k norms)
    xd, wd = x.detach().double(), w.detach().double()
    ref = wd * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (full.detach().double() - ref).abs().max() < 1e-5
    gy = torch.randn(37, 96, generator=gen)
    full.backward(gy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (wr * xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(gy)
    assert torch.allclose(x.grad, xr.grad, atol=1e-4) and torch.allclose(w.grad, wr.grad, atol=1e-4)
