"""The FP8 kernel's pipelined launch (MTRAIN_FP8_PIPELINE: a fixed number of programs looping over the whole blocks,
the next block's loads issued before this one is quantized) gives the float64 reference's bytes, and is used only
where its loads and stores need no branch: otherwise the one-block-per-program launch runs, with the same result."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp8_mantissa_blocks import build, mismatches
from mtrain.kernels import triton_fp8 as tf


class _LaunchSpy:
    """Stands in for tf._fp8_blocks_kernel: records (programs, blocks, STAGES, ALIGNED) per launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid[0], args[-1], kw["STAGES"], kw["ALIGNED"]))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def spy(monkeypatch):
    s = _LaunchSpy(tf._fp8_blocks_kernel)
    monkeypatch.setattr(tf, "_fp8_blocks_kernel", s)
    return s


@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_launch_equals_float64(stages, spy, monkeypatch):
    monkeypatch.setattr(tf, "PIPELINE", stages)
    w, n = build(torch.bfloat16, amax_every=16, exponents=(0,), fallback_every=64)
    assert mismatches(w) == (0, 0)
    assert spy.launches == [(3, n, stages, True)]  # the interpreter's 3 programs loop over all n blocks


def test_unaligned_source_takes_the_plain_launch(spy, monkeypatch):
    monkeypatch.setattr(tf, "PIPELINE", 2)
    w, n = build(torch.bfloat16, amax_every=32, exponents=(0,), fallback_every=128)
    buf = torch.empty(w.numel() + 1, dtype=w.dtype)
    shifted = buf[1:].view(w.shape)  # 2 bytes past a 16-byte boundary
    shifted.copy_(w)
    assert mismatches(shifted) == (0, 0)
    assert spy.launches == [(n, n, 0, False)]


def test_off_by_default(spy):
    assert tf.PIPELINE == 0
    w, n = build(torch.float16, amax_every=256)
    assert mismatches(w) == (0, 0) and spy.launches == [(n, n, 0, False)]


def test_whole_blocks_aligned_checks_every_offset():
    import numpy as np

    from mtrain.kernels.fp8 import BLOCK_FIELDS, SUB_FIELDS
    blocks = np.zeros((2, BLOCK_FIELDS), np.int64)
    blocks[:, 0], blocks[:, 2], blocks[:, 4], blocks[:, 5] = [0, 128], 256, 128, [0, 1]
    subs = np.zeros((2, SUB_FIELDS), np.int64)
    subs[:, 1], subs[:, 2] = [0, 8192], 256
    vecs = np.array([8])
    assert tf.whole_blocks_aligned(blocks, subs, 2, vecs)
    for table, row, field, value in [(subs, 1, 1, 8193), (subs, 0, 2, 260), (blocks, 1, 0, 130), (blocks, 0, 4, 120)]:
        saved = table[row, field]
        table[row, field] = value
        assert not tf.whole_blocks_aligned(blocks, subs, 2, vecs), (field, value)
        table[row, field] = saved
    assert not tf.whole_blocks_aligned(blocks, subs, 0, vecs)


@pytest.mark.parametrize("name,value", [("MTRAIN_FP8_PIPELINE", "-1"), ("MTRAIN_FP8_PIPELINE", "two"),
                                        ("MTRAIN_FP8_RCP_DIV", "yes"), ("MTRAIN_FP8_MAXNREG", "-64")])
def test_a_bad_knob_is_refused_at_import(name, value):
    env = dict(os.environ, **{name: value})
    proc = subprocess.run([sys.executable, "-c", "import mtrain.kernels.triton_fp8"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert f"ValueError: {name}={value!r}: expected" in proc.stderr.splitlines()[-1], proc.stderr
