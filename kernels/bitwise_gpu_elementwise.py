"""One-launch GPU forms of the bitwise mode's elementwise ops: SwiGLU's silu(gate) * up and RoPE's rotation (Triton).

Why: the torch forms (mtrain/kernels/bitwise_ops.py) are the same bits on a GPU whatever the shape, but each is a
chain of launches over [tokens x width] tensors: silu_mul goes through float64 (about seven passes of 8-byte elements
over Qwen3-1.7B's 6,144-wide MLP per layer), RoPE through float32 copies, slices, four products and a concatenation.
Here each is one pass that reads its inputs once and writes its output once.

Equal bits need one compiled kernel on both sides, which holds: an element's result depends only on its own inputs
(no reduction, no neighbour), and the element count is not specialised, so a decode step, a prefill chunk and the
trainer's packed micro-batch run the same per-element arithmetic. The values are not the torch forms' bits (float32
exp instead of a rounded float64 one): the mode needs the two sides equal to each other, and both call these.

Backward passes use torch on the saved inputs (the gradient needs no bitwise agreement).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of a row per program (silu_mul)
# MTRAIN_BITWISE_ELEMENTWISE=torch keeps the torch forms on the GPU too (both sides: the variable reaches SGLang's
# scheduler processes), for measuring what these kernels save.
ELEMENTWISE = os.environ.get("MTRAIN_BITWISE_ELEMENTWISE", "fused")
if ELEMENTWISE not in ("fused", "torch"):
    raise ValueError(f"MTRAIN_BITWISE_ELEMENTWISE must be fused or torch, got {ELEMENTWISE!r}")


@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_rows, width, s_gate, s_up, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    g = tl.load(gate_ptr + row * s_gate + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * s_up + col, mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * s_out + col, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit stride along the width (a view where it can be: gate and up are often halves of
    one fused gate|up output)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        g, u = _rows(gate), _rows(up)
        out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
        if g.shape[0] and g.shape[1]:
            grid = (g.shape[0], triton.cdiv(g.shape[1], BLOCK))
            _silu_mul_kernel[grid](g, u, out, g.shape[0], g.shape[1], g.stride(0), u.stride(0), out.stride(0),
                                   BLOCK=BLOCK, num_warps=4)
        return out.reshape(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, u, d = gate.float(), up.float(), grad.float()
        sig = torch.sigmoid(g)
        d_up = d * g * sig
        d_gate = d * u * sig * (1.0 + g * (1.0 - sig))
        return d_gate.to(gate.dtype), d_up.to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32, rounded to gate's dtype; gate and up [..., F] on one CUDA device. Differentiable."""
    return _SiluMul.apply(gate, up)


@triton.jit(do_not_specialize=["n_tokens"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens, half, s_xt, s_xh, s_ot, s_oh, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    mask = i < half
    x = x_ptr + t * s_xt + h * s_xh
    x1 = tl.load(x + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + half + i, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0)
    o = out_ptr + t * s_ot + h * s_oh
    tl.store(o + i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o + half + i, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        t, h, d = x.shape
        src = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
        if t and h:
            _rope_kernel[(t, h)](src, cos, sin, out, t, d // 2, src.stride(0), src.stride(1), out.stride(0),
                                 out.stride(1), HALF=triton.next_power_of_2(d // 2), num_warps=1)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors  # the rotation's transpose: by -angle
        g = grad.float()
        half = g.shape[-1] // 2
        g1, g2 = g[..., :half], g[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(grad.dtype), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] by float32 cos and sin [T, D/2] (contiguous), float32 inside, rounded to x's
    dtype. Differentiable in x."""
    return _Rope.apply(x, cos.contiguous(), sin.contiguous())
