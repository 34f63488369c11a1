"""Whether this Triton's interpreter rounds tl.fma once, as the GPU does (Triton 3.9's does; 3.7.1's, the one PyPI's
CUDA torch 2.13 pins, computes the multiply-add in float64 and then casts, a second rounding)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(b_ptr), tl.load(c_ptr)))


@functools.cache
def interpreter_fma_rounds_once() -> bool:
    """1.015625 * 5.868765e-08 + 1 lies just above a float32 midpoint that float64 arithmetic rounds onto: a
    single rounding gives 1 + 2**-23, a float64 multiply-add then a float32 cast gives 1.0."""
    a = torch.tensor([1.015625]), torch.tensor([5.868765e-08]), torch.tensor([1.0])
    out = torch.empty(1)
    _fma_kernel[(1,)](*a, out)
    return float(out) == float(torch.tensor(1.0).nextafter(torch.tensor(2.0)))
