"""The bitwise mode's one-launch elementwise kernels (kernels/bitwise_gpu_elementwise.py) in Triton's interpreter: a
row's result does not depend on the rows beside it, the values are right against float64 math written from the
formulas, strided views (halves of a fused gate|up output, q/k slices of a fused QKV) read as their copies do, and
the backward equals autograd through the formula."""
from __future__ import annotations

import torch

from mtrain.kernels import bitwise_gpu_elementwise as e


def _silu_mul64(gate, up):
    g = gate.double()
    return g / (1.0 + torch.exp(-g)) * up.double()


def _rope64(x, cos, sin):
    half = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    return torch.cat([xd[..., :half] * c - xd[..., half:] * s, xd[..., half:] * c + xd[..., :half] * s], dim=-1)


def _angles(n, half, gen):
    ang = torch.rand(n, half, generator=gen, dtype=torch.float64) * 100
    return torch.cos(ang).float(), torch.sin(ang).float()


def test_silu_mul_rows_are_independent_of_the_batch_and_right():
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(37, 2 * 1100, generator=gen)  # 1,100 wide: one full and one partial block
    gate, up = fused[:, :1100], fused[:, 1100:]  # views with row stride 2,200, as a fused gate|up output gives
    out = e.silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == gate.dtype
    for lo, hi in ((0, 1), (5, 6), (3, 37)):
        assert torch.equal(e.silu_mul(gate[lo:hi], up[lo:hi]), out[lo:hi]), (lo, hi)
    assert torch.equal(e.silu_mul(gate.contiguous(), up.contiguous()), out)
    assert (out.double() - _silu_mul64(gate, up)).abs().max() < 1e-5 * _silu_mul64(gate, up).abs().max()
    # 3-D input (a [batch, seq, F] caller) keeps its shape
    assert torch.equal(e.silu_mul(gate.reshape(1, 37, 1100), up.reshape(1, 37, 1100)).reshape(37, 1100), out)


def test_silu_mul_rounds_once_to_bf16():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(9, 300, generator=gen).bfloat16(), torch.randn(9, 300, generator=gen).bfloat16()
    out = e.silu_mul(gate, up)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _silu_mul64(gate, up).float().bfloat16()) or \
        (out.float() - _silu_mul64(gate, up)).abs().max() <= 2 ** -7 * _silu_mul64(gate, up).abs().max()


def test_silu_mul_backward_matches_autograd_of_the_formula():
    gen = torch.Generator().manual_seed(2)
    gate = torch.randn(6, 40, generator=gen, dtype=torch.float32, requires_grad=True)
    up = torch.randn(6, 40, generator=gen, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(6, 40, generator=gen)
    gg, gu = torch.autograd.grad(e.silu_mul(gate, up), (gate, up), grad)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    rg, ru = torch.autograd.grad(_silu_mul64(g64, u64), (g64, u64), grad.double())
    assert torch.allclose(gg.double(), rg, atol=1e-5) and torch.allclose(gu.double(), ru, atol=1e-5)


def test_rope_rows_are_independent_of_the_batch_and_right():
    gen = torch.Generator().manual_seed(3)
    for dim in (64, 128, 96):  # 96: a half of 48, padded to 64 lanes
        qkv = torch.randn(23, 4 + 2 + 2, dim, generator=gen)  # a fused QKV's heads: q is a strided view
        q = qkv[:, :4]
        cos, sin = _angles(23, dim // 2, gen)
        out = e.rope(q, cos, sin)
        assert out.shape == q.shape
        for lo, hi in ((0, 1), (7, 8), (2, 23)):
            assert torch.equal(e.rope(q[lo:hi], cos[lo:hi], sin[lo:hi]), out[lo:hi]), (dim, lo, hi)
        assert torch.equal(e.rope(q.contiguous(), cos, sin), out)
        assert (out.double() - _rope64(q, cos, sin)).abs().max() < 1e-5


def test_rope_backward_is_the_inverse_rotation():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 64, generator=gen, requires_grad=True)
    cos, sin = _angles(5, 32, gen)
    grad = torch.randn(5, 3, 64, generator=gen)
    (gx,) = torch.autograd.grad(e.rope(x, cos, sin), (x,), grad)
    x64 = x.detach().double().requires_grad_()
    (rx,) = torch.autograd.grad(_rope64(x64, cos, sin), (x64,), grad.double())
    assert torch.allclose(gx.double(), rx, atol=1e-5)
