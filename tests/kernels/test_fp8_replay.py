"""execute_scatter with FP8 destinations replays its latest call's launches (scatter_fp8's "fp8_replay") when every
destination, source and scale tensor, the stream and the kernel's knobs match that call; anything else prepares
(checks included) again. Each result is compared with the independent float64 reference (test_kernels_fp8), not
with an earlier call's output; the destinations are poisoned before every call so a launch that did not run shows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mtrain.kernels import BlockFp8, PieceTableError, ScatterTable, execute_scatter, scale_shape
from mtrain.kernels import scatter_fp8
from mtrain.kernels import triton_fp8 as tf
from mtrain.kernels.fp8 import FP8
from test_kernels_fp8 import bits, random_layout, ref_quant

SHAPE, BLOCK = (257, 300), (128, 128)


@pytest.fixture
def prepares(monkeypatch):
    """Counts the full preparations (checks, plans, launch arguments) of FP8 calls."""
    calls = []
    real = scatter_fp8.prepare_fp8

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(scatter_fp8, "prepare_fp8", counting)
    return calls


class Call:
    """One FP8 weight (2 source dtypes, pieces straddling blocks) plus one plain bf16 destination, one table."""

    def __init__(self, seed=3):
        rng = np.random.default_rng(seed)
        self.full, self.srcs, rows = random_layout(SHAPE, rng, (torch.bfloat16, torch.float32))
        self.plain_src = torch.randn(40, dtype=torch.float32)
        self.srcs = self.srcs + [self.plain_src]
        rows = [r[:7] + [1] for r in rows] + [[len(self.srcs) - 1, 0, 40, 0, 40, 1, 40, 0]]
        self.table = ScatterTable.from_rows(rows)
        self.w = torch.empty(SHAPE[0] * SHAPE[1], dtype=FP8)
        self.scale = torch.empty(int(np.prod(scale_shape(SHAPE, BLOCK))))
        self.norm = torch.empty(40, dtype=torch.bfloat16)

    def run(self, srcs=None, scale=None):
        scale = self.scale if scale is None else scale
        bits(self.w).fill_(0x7F)
        scale.fill_(float("nan"))
        self.norm.fill_(float("nan"))
        execute_scatter([self.norm, self.w], self.srcs if srcs is None else srcs, self.table, backend="triton",
                        quant={1: BlockFp8(scale, SHAPE, BLOCK)})
        return scale

    def check(self, full=None, scale=None, plain=None):
        rq, rs = ref_quant(self.full if full is None else full, BLOCK)
        assert torch.equal(bits(self.w.view(SHAPE)), bits(rq))
        assert torch.equal((self.scale if scale is None else scale).view(rs.shape), rs)
        assert torch.equal(self.norm, (self.plain_src if plain is None else plain).to(torch.bfloat16))


def test_a_repeated_call_replays_and_writes_everything_again(prepares):
    c = Call()
    c.run()
    c.check()
    for _ in range(2):
        c.run()
        c.check()  # FP8 weights, scales and the plain destination: every launch ran again
    assert len(prepares) == 1


def test_new_source_tensors_prepare_again(prepares):
    c = Call()
    c.run()
    new = [s.clone() * 2 for s in c.srcs]  # other addresses, other values
    c.run(srcs=new)
    c.check(full=c.full * 2, plain=new[-1])
    assert len(prepares) == 2
    c.run()  # and back: the old tensors are prepared again (only the latest call is kept)
    c.check()
    assert len(prepares) == 3


def test_a_source_written_in_place_is_read_again_on_replay(prepares):
    """A replay rereads the sources: the trainer updates its shards in place between syncs."""
    c = Call()
    c.run()
    with torch.no_grad():
        for s in c.srcs:
            s.mul_(-0.5)
    c.run()
    c.check(full=c.full * -0.5)
    assert len(prepares) == 1


def test_another_scale_tensor_or_knob_prepares_again(prepares, monkeypatch):
    c = Call()
    c.run()
    other = torch.empty_like(c.scale)
    c.run(scale=other)
    c.check(scale=other)
    monkeypatch.setattr(tf, "FAST_PATH", not tf.FAST_PATH)
    c.run()
    c.check()
    assert len(prepares) == 3


def test_bad_input_after_a_replayed_call_is_refused_with_nothing_written(prepares):
    c = Call()
    c.run()
    c.run()
    short = list(c.srcs)
    short[0] = short[0][:1].clone()  # one element: its pieces read past its end
    bits(c.w).fill_(0x11)
    before = bits(c.w).clone()
    with pytest.raises(PieceTableError, match=r"reads src 0 elements up to"):
        execute_scatter([c.norm, c.w], short, c.table, backend="triton", quant={1: BlockFp8(c.scale, SHAPE, BLOCK)})
    assert torch.equal(bits(c.w), before)
    c.run()  # the bad call was prepared (and refused) but kept nothing: the good one after it replays
    c.check()
    assert len(prepares) == 2


def test_a_quant_spec_that_is_not_a_blockfp8_gets_the_usual_error():
    c = Call()
    c.run()
    with pytest.raises(PieceTableError):
        execute_scatter([c.norm, c.w], c.srcs, c.table, backend="triton", quant={1: "fp8"})
