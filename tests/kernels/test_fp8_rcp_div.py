"""The FP8 kernel's division through the block's reciprocal (kernels/triton_fp8.py `_quotient`, RCP_DIV) equals
the IEEE quotient's quantization bit for bit: every (element mantissa, amax mantissa) pair of bf16 and fp16, at
every exponent step that matters, against the float64 reference (fp8_diagnose.quantize_f64; the weights are built
by fp8_mantissa_blocks, whose docstring says why the pairs cover every in-range case). The interpreter runs the same
kernel code (its fma rounds once, as the GPU's). Without the correction step, 408 of these bf16 bytes differ;
without the sign step, every -0.0 (the H200 found that one: docs/archive/results-2026-11.md section 36).
"""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from compiled_script import run_compiled
from fp8_mantissa_blocks import build, mismatches
from interpreter_fma import interpreter_fma_rounds_once
from mtrain.kernels import triton_fp8 as tf


class _KwargSpy:
    """Stands in for tf._fp8_blocks_kernel: records each launch's RCP_DIV, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.rcp = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.rcp.append(kw["RCP_DIV"])
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def spy(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1" and not interpreter_fma_rounds_once():
        pytest.skip("this Triton's interpreter rounds tl.fma twice; the kernel's exact remainder needs one rounding")
    s = _KwargSpy(tf._fp8_blocks_kernel)
    monkeypatch.setattr(tf, "_fp8_blocks_kernel", s)
    return s


def test_bf16_every_mantissa_pair_and_the_fallback_scales(spy):
    w, n = build(torch.bfloat16, exponents=(0,), fallback_every=16)
    assert n == 128 + 4 * 8
    assert mismatches(w) == (0, 0)
    assert spy.rcp == [True]  # one launch (every block whole), on the reciprocal path


def test_fp16_every_32nd_amax_mantissa(spy):
    w, n = build(torch.float16, amax_every=32)
    assert n == 32 * 3
    assert mismatches(w) == (0, 0) and spy.rcp == [True]


def test_float32_sources_divide(spy):
    w, _ = build(torch.bfloat16, amax_every=64, exponents=(0,), fallback_every=128)
    assert mismatches(w.float()) == (0, 0) and spy.rcp == [False]


def test_the_knob_turns_it_off(spy, monkeypatch):
    monkeypatch.setattr(tf, "RCP_DIV", False)
    w, _ = build(torch.bfloat16, amax_every=64, exponents=(0,), fallback_every=128)
    assert mismatches(w) == (0, 0) and spy.rcp == [False]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_pair_at_every_placement(dtype):
    w, _ = build(dtype, fallback_every=1)
    assert mismatches(w) == (0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_on_every_pair():
    run_compiled("fp8_mantissa_blocks.py", "all blocks equal")
