"""The Triton FP8 kernel's fast path: blocks that one sub-piece covers whole (plan_blocks' WHOLE flag) go through
their own launch, compiled without the per-piece masks and selects. One hand-made table mixes every kind of block:
whole interior blocks (16-byte aligned and not, bf16 / fp32 / fp16 sources), whole blocks partial at the weight's
edge, blocks straddling pieces (split by rows, split by columns), a zero fill, an all-zero block with -0.0; the
result must equal the torch executor and the float64 reference bit for bit, fast path on or off, one pass or two.
The planner's tables are checked in tests/reshard/test_fp8_whole_blocks.py.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from mtrain.kernels import BlockFp8, ScatterTable
from mtrain.kernels import triton_fp8 as tf
from mtrain.kernels.fp8 import WHOLE, plan_blocks
from test_kernels_fp8 import bits, ref_quant, run_fp8

SHAPE, BLOCK = (300, 600), (128, 128)  # 3 x 5 blocks: the last block row is 44 rows, the last block column 88 cols
# WHOLE per block, row-major over the 3 x 5 blocks (see mixed_layout)
WANT = [1, 1, 1, 1, 1,
        0, 0, 0, 1, 1,
        1, 0, 1, 1, 0]


def mixed_layout():
    """(float64 values of the weight, sources, table rows) for SHAPE, pieces as rectangles (r0, r1, c0, c1):
    A  bf16 [0, 200) x [0, 384)    offset 8, stride 392: aligned     -> blocks (0, 0..2) whole
    A2 bf16 [200, 256) x [0, 384)                                    -> blocks (1, 0..2) straddle A / A2 by rows
    B  fp32 [0, 256) x [384, 600)  offset 3, stride 217: unaligned   -> (0..1, 3) whole, (0..1, 4) whole + edge
    C  bf16 [256, 300) x [0, 200)  zeros with -0.0 in block (2, 0)   -> (2, 0) whole + edge (44 rows)
    D  fp16 [256, 300) x [200, 512)                                  -> (2, 1) straddles C / D by columns; (2, 2..3)
    a zero fill [256, 300) x [512, 600)                              -> (2, 4) general path (no source to load)"""
    g = torch.Generator().manual_seed(11)
    full = torch.zeros(SHAPE, dtype=torch.float64)
    srcs, rows = [], []
    for r0, r1, c0, c1, dtype, off, pad, scale in [(0, 200, 0, 384, torch.bfloat16, 8, 8, 1e-2),
                                                   (200, 256, 0, 384, torch.bfloat16, 0, 0, 3.0),
                                                   (0, 256, 384, 600, torch.float32, 3, 1, 1e-4),
                                                   (256, 300, 0, 200, torch.bfloat16, 5, 2, 1.0),
                                                   (256, 300, 200, 512, torch.float16, 1, 3, 10.0)]:
        nr, nc = r1 - r0, c1 - c0
        buf = (torch.randn(off + nr * (nc + pad), generator=g) * scale).to(dtype)
        vals = buf[off:].view(nr, nc + pad)[:, :nc]
        if c0 == 0 and r0 == 256:  # block (2, 0): all zeros, some negative (scale 0, signed zero bytes)
            vals[:, :128] = 0.0
            vals[::3, :128] = -0.0
        full[r0:r1, c0:c1] = vals.to(torch.float64)
        rows.append([len(srcs), off, nc + pad, r0 * SHAPE[1] + c0, SHAPE[1], nr, nc, 0])
        srcs.append(buf)
    rows.append([-1, 0, 0, 256 * SHAPE[1] + 512, SHAPE[1], 44, 88, 0])
    return full, srcs, rows[::-1]  # table order must not matter


class _KernelSpy:
    """Stands in for tf._fp8_blocks_kernel: records (programs, FAST) per launch, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid[0], kw["FAST"]))
            return self.kernel[grid](*args, **kw)
        return launch


def test_whole_flag_marks_the_blocks_one_sub_piece_covers():
    _, _, rows = mixed_layout()
    spec = BlockFp8(torch.empty(15), SHAPE, BLOCK)
    blocks, subs = plan_blocks(np.asarray(rows, np.int64)[:, :7], np.arange(len(rows)), spec)
    assert blocks[np.argsort(blocks[:, 1]), WHOLE].tolist() == WANT
    whole = blocks[blocks[:, WHOLE] == 1]
    one = subs[whole[:, 5]]
    assert (whole[:, 6] - whole[:, 5] == 1).all() and (one[:, 0] >= 0).all()
    assert (one[:, 3:5] == 0).all() and (one[:, 5] == whole[:, 3]).all() and (one[:, 6] == whole[:, 4]).all()


@pytest.mark.parametrize("step", [None, 16])
@pytest.mark.parametrize("fast", [True, False])
def test_mixed_blocks_equal_torch_and_float64(step, fast, monkeypatch):
    full, srcs, rows = mixed_layout()
    spy = _KernelSpy(tf._fp8_blocks_kernel)
    monkeypatch.setattr(tf, "_fp8_blocks_kernel", spy)
    monkeypatch.setattr(tf, "FAST_PATH", fast)
    if step:  # the GPU's two-pass branch (STEP_ROWS < block rows), which the fast path shares
        monkeypatch.setattr(tf, "launch_fp8", functools.partial(tf.launch_fp8, step=step))
    q, s = run_fp8(SHAPE, srcs, rows, "triton", BLOCK)
    assert spy.launches == ([(sum(WANT), True), (15 - sum(WANT), False)] if fast else [(15, False)])
    rq, rs = ref_quant(full, BLOCK)
    tq, ts = run_fp8(SHAPE, srcs, rows, "torch", BLOCK)
    assert torch.equal(bits(q), bits(rq)) and torch.equal(s, rs)
    assert torch.equal(bits(tq), bits(rq)) and torch.equal(ts, rs)
    assert s[2, 0] == 0 and bool((bits(q).view(SHAPE)[256::3, :128] == 0x80).all())


def test_rebase_puts_whole_blocks_first_and_keeps_their_sub_pieces():
    """Two destinations in one call: whole blocks of both first, each still pointing at its own sub-pieces."""
    _, _, rows = mixed_layout()
    plan = plan_blocks(np.asarray(rows, np.int64)[:, :7], np.arange(len(rows)), BlockFp8(torch.empty(15), SHAPE, BLOCK))
    smap = np.arange(8)
    b, s, wa, sa = tf.rebase([plan, plan], [1 << 20, 1 << 10], [4096, 1024], [smap, smap])
    n = sum(WANT)
    assert b[:2 * n, WHOLE].all() and not b[2 * n:, WHOLE].any() and (wa, sa) == (1, 1)
    for blk in b:  # every block keeps its (first, end) range over the concatenated sub-pieces, same contents
        own = plan[1][blk[5] % len(plan[1]):][:blk[6] - blk[5]]
        assert np.array_equal(s[blk[5]:blk[6]], own)
