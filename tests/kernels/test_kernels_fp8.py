"""Block-FP8 destinations of execute_scatter (kernels/fp8.py, triton_fp8.py, scatter_fp8.py), TRITON_INTERPRET=1.

The reference is written here, independently, in float64: per block amax, scale = float32(amax / 448), values
x / scale rounded to float32 (innocuous double rounding: binary64 carries more than 2*24+2 bits), clamped, then
torch's own cast to float8_e4m3fn. The Triton kernel and the torch executor must equal it bit for bit, values and
scales, on odd shapes, blocks straddling pieces from several sources, slotted (MoE) destinations, runs that wrap
rows, mixed plain + FP8 calls; and each bad input must be refused with nothing written.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from mtrain.kernels import (BlockFp8, PieceTableError, ScatterTable, dequantize_blocks, execute_scatter,
                            quantize_blocks, scale_shape)
from mtrain.kernels.triton_fp8 import _e4m3_bits

FP8 = torch.float8_e4m3fn


def ref_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 block quantization, block by block (no padding tricks): (fp8 values, float32 scales)."""
    x = w.to(torch.float64)
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])
    n, k = x3.shape[-2:]
    bn, bk = block
    q = torch.empty(x3.shape, dtype=FP8)
    s = torch.empty(x3.shape[0], -(-n // bn), -(-k // bk), dtype=torch.float32)
    for e in range(x3.shape[0]):
        for i in range(0, n, bn):
            for j in range(0, k, bk):
                blk = x3[e, i:i + bn, j:j + bk]
                scale = torch.tensor(float(blk.abs().max()) / 448.0, dtype=torch.float64).to(torch.float32)
                s[e, i // bn, j // bk] = scale
                if scale > 0:
                    v = (blk / scale.to(torch.float64)).clamp(-448.0, 448.0)
                else:
                    v = blk * 0.0
                q[e, i:i + bn, j:j + bk] = v.to(torch.float32).to(FP8)
    return q.reshape(*lead, n, k), s.reshape(*lead, *s.shape[1:])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# The e4m3 rounding on the bits vs torch's cast.

@triton.jit
def _bits_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, _e4m3_bits(tl.load(x_ptr + i)))


def test_e4m3_bits_equal_torch_cast():
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float32)
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2  # some exact halfway points (ties to even)
    near = torch.cat([mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9))])
    rnd = torch.randn(4096) * torch.logspace(-12, 2.6, 4096)
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -7,
                         448.0, -448.0, 2.0 ** -6, -(2.0 ** -6), 2.0 ** -6 * 0.9999])
    x = torch.cat([grid, mids, near, rnd, tiny]).clamp(-448, 448).contiguous()
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[:x.numel()] = x
    y = torch.empty(n, dtype=torch.uint8)
    _bits_kernel[(1,)](xp, y, N=n)
    want = bits(x.to(FP8))
    bad = torch.nonzero(y[:x.numel()] != want).flatten()
    assert bad.numel() == 0, [(float(x[i]), int(y[i]), int(want[i])) for i in bad[:5]]


# ---------------------------------------------------------------------------------------------------------------
# Random piece layouts: a destination cut into rectangles fed from several sources.

def _cut(n: int, parts: int, rng) -> list[int]:
    cuts = sorted(rng.choice(np.arange(1, n), size=min(parts, n) - 1, replace=False).tolist()) if n > 1 else []
    return [0] + cuts + [n]


def random_layout(shape, rng, dtypes=(torch.bfloat16,), n_row_cuts=3, n_col_cuts=2, runs=True):
    """Cut a [slots, N, K] destination into row bands x column bands, each band fed from its own source tensor
    (a random dtype, at a random offset and row stride); a band of whole rows may be sent as one contiguous run.
    Returns (full float tensor of the values the destination must hold, sources, rows of a 1-destination table)."""
    slots, n, k = (1, *shape) if len(shape) == 2 else shape
    full = torch.empty(slots * n, k, dtype=torch.float64)
    srcs, rows = [], []
    for e in range(slots):
        rc = _cut(n, n_row_cuts, rng)
        for r0, r1 in zip(rc, rc[1:]):
            whole = runs and rng.random() < 0.4
            cc = [0, k] if whole else _cut(k, n_col_cuts, rng)
            for c0, c1 in zip(cc, cc[1:]):
                nr, nc = r1 - r0, c1 - c0
                dt = dtypes[int(rng.integers(len(dtypes)))]
                stride = nc if whole else nc + int(rng.integers(0, 5))
                off = int(rng.integers(0, 7))
                scale = float(10.0 ** rng.uniform(-3, 2))
                buf = (torch.randn(off + nr * stride + 3, dtype=torch.float32) * scale).to(dt)
                vals = buf[off:off + nr * stride].view(nr, stride)[:, :nc]
                full[e * n + r0:e * n + r1, c0:c1] = vals.to(torch.float64)
                i = len(srcs)
                srcs.append(buf)
                d_off = (e * n + r0) * k + c0
                if whole:
                    rows.append([i, off, nr * nc, d_off, nr * nc, 1, nr * nc, 0])
                else:
                    rows.append([i, off, stride, d_off, k, nr, nc, 0])
    order = rng.permutation(len(rows))
    return full.view(*shape), srcs, [rows[j] for j in order]


def run_fp8(shape, srcs, rows, backend, block=(128, 128), poison=True):
    dst = torch.empty(int(np.prod(shape)), dtype=FP8)
    bits(dst).fill_(0x7F)  # NaN bytes: anything left unwritten shows
    scale = torch.full((int(np.prod(scale_shape(tuple(shape), block))),), float("nan"))
    execute_scatter([dst], srcs, ScatterTable.from_rows(rows), backend=backend,
                    quant={0: BlockFp8(scale, tuple(shape), block)})
    return dst.view(shape), scale.view(scale_shape(tuple(shape), block))


CASES = [  # (shape, block, dtypes, seed)
    ((200, 300), (128, 128), (torch.bfloat16,), 0),
    ((257, 129), (128, 128), (torch.bfloat16, torch.float32), 1),
    ((3, 70, 90), (32, 64), (torch.bfloat16, torch.float16), 2),  # slots: blocks restart at every slot
    ((1, 1), (128, 128), (torch.float32,), 3),
    ((130, 7), (64, 128), (torch.bfloat16,), 4),
    ((2, 96, 200), (32, 32), (torch.bfloat16, torch.float32, torch.float16), 5),
]


@pytest.mark.parametrize("shape,block,dtypes,seed", CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_scatter_equals_float64_reference(shape, block, dtypes, seed, backend):
    rng = np.random.default_rng(seed)
    full, srcs, rows = random_layout(shape, rng, dtypes)
    q, s = run_fp8(shape, srcs, rows, backend, block)
    rq, rs = ref_quant(full, block)
    assert torch.equal(bits(q), bits(rq))
    assert torch.equal(s, rs)
    # and the torch helper used offline (checkpoints, the GPU check) agrees too
    hq, hs = quantize_blocks(full.to(torch.float32), block)
    assert torch.equal(bits(hq), bits(rq)) and torch.equal(hs, rs)
    # dequantized error: at most half an e4m3 step (3 mantissa bits) relative to the block's scale grid
    deq = dequantize_blocks(q, s, block).to(torch.float64)
    step = s.to(torch.float64).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    step = step[..., :shape[-2], :shape[-1]]
    assert bool(((deq - full).abs() <= torch.maximum(full.abs() * 2.0 ** -4, step * 2.0 ** -9) * 1.0001).all())


def test_zero_block_negative_zero_and_tiny_values():
    x = torch.zeros(128, 256, dtype=torch.float32)
    x[0, 0] = -0.0
    x[5, 130:140] = torch.tensor([1e-3, -2e-6, 3e-9, 0.0, -0.0, 7e-3, -7e-3, 1e-38, -1e-38, 2e-3])
    rows = [[0, 0, 256, 0, 256, 128, 256, 0]]
    for backend in ("triton", "torch"):
        q, s = run_fp8((128, 256), [x], rows, backend)
        rq, rs = ref_quant(x, (128, 128))
        assert torch.equal(bits(q), bits(rq)) and torch.equal(s, rs)
        assert s[0, 0] == 0 and bits(q)[0] == 0x80  # an all-zero block: scale 0, signed zeros


def test_mixed_plain_and_fp8_destinations_in_one_call():
    rng = np.random.default_rng(7)
    full, srcs, rows = random_layout((150, 140), rng, (torch.bfloat16,))
    plain_src = torch.randn(50, dtype=torch.float32)
    for backend in ("triton", "torch"):
        wbuf = torch.empty(150 * 140, dtype=FP8)
        scale = torch.empty(4)
        norm = torch.full((50,), float("nan"), dtype=torch.bfloat16)
        ex = [r[:7] + [1] for r in rows] + [[len(srcs), 0, 50, 0, 50, 1, 50, 0]]
        execute_scatter([norm, wbuf], srcs + [plain_src], ScatterTable.from_rows(ex), backend=backend,
                        quant={1: BlockFp8(scale, (150, 140))})
        rq, rs = ref_quant(full, (128, 128))
        assert torch.equal(norm, plain_src.to(torch.bfloat16))
        assert torch.equal(bits(wbuf), bits(rq)) and torch.equal(scale.view(2, 2), rs)


def test_partial_update_of_whole_blocks_leaves_the_rest():
    """Rows [64, 128) of a [3*64, 100] slotted weight with 64-row blocks: slot 1 only (push mode's '@a:b')."""
    w = torch.randn(64, 100).to(torch.bfloat16)
    for backend in ("triton", "torch"):
        dst = torch.zeros(3 * 64 * 100, dtype=FP8)
        scale = torch.full((3 * 1 * 1,), -1.0)
        execute_scatter([dst], [w], ScatterTable.from_rows([[0, 0, 6400, 6400, 6400, 1, 6400, 0]]), backend=backend,
                        quant={0: BlockFp8(scale, (3, 64, 100), (64, 128))})
        rq, rs = ref_quant(w, (64, 128))
        assert torch.equal(bits(dst)[6400:12800], bits(rq))
        assert bool((bits(dst)[:6400] == 0).all()) and bool((bits(dst)[12800:] == 0).all())
        assert scale.tolist() == [-1.0, float(rs.reshape(-1)[0]), -1.0]


def _bad(call, match):
    with pytest.raises(PieceTableError, match=match):
        call()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_is_refused_before_any_write(backend):
    src = torch.randn(4096).to(torch.bfloat16)
    dst = torch.zeros(64 * 64, dtype=FP8)
    scale = torch.full((1,), -1.0)
    plain = torch.zeros(8, dtype=torch.bfloat16)
    full = [[0, 0, 64, 0, 64, 64, 64, 0]]

    def go(rows, dsts=None, quant=None, srcs=(src,)):
        dsts = [dst, plain] if dsts is None else dsts
        execute_scatter(dsts, list(srcs), ScatterTable.from_rows(rows), backend=backend,
                        quant={0: BlockFp8(scale, (64, 64))} if quant is None else quant)

    # half a block: its scale would come from half the data
    _bad(lambda: go([[0, 0, 64, 0, 64, 32, 64, 0], [0, 0, 8, 0, 8, 1, 8, 1]]), r"written 2048 of 4096 elements")
    _bad(lambda: go(full, quant={0: BlockFp8(torch.zeros(2), (64, 64))}), r"scale has 2 elements")
    _bad(lambda: go(full, quant={0: BlockFp8(scale, (64, 32))}), r"4096 elements but the FP8 spec says")
    _bad(lambda: go(full, dsts=[torch.zeros(4096, dtype=torch.bfloat16), plain]), r"must be torch.float8_e4m3fn")
    _bad(lambda: go(full, quant={0: BlockFp8(scale.double(), (64, 64))}), r"flat contiguous float32")
    _bad(lambda: go(full, quant={1: BlockFp8(scale, (64, 64))}), r"must be torch.float8_e4m3fn")
    _bad(lambda: go(full, quant={5: BlockFp8(scale, (64, 64))}), r"quant names dsts\[5\]")
    _bad(lambda: go(full, srcs=(src.view(torch.int16),)), r"quantized from")
    _bad(lambda: go([[0, 0, 64, 0, 100, 2, 10, 0]]), r"not a rectangle")  # row stride != cols, not a run
    _bad(lambda: go([[0, 0, 64, 0, 64, 64, 65, 0]]), r"writes dst elements up to 4097")
    # a scale sharing bytes with the weight
    shared = torch.zeros(64 * 64 + 8, dtype=torch.uint8)
    w_view, s_view = shared[:4096].view(FP8), shared[4092:4096].view(torch.float32)
    _bad(lambda: go(full, dsts=[w_view, plain], quant={0: BlockFp8(s_view, (64, 64))}), r"overlap in memory")
    assert bool((bits(dst) == 0).all()) and scale.item() == -1.0 and bool((plain == 0).all())


@pytest.mark.parametrize("shape,block,dtypes,seed", [CASES[1], CASES[2], CASES[5]])
def test_fp8_two_pass_steps_equal_float64_reference(shape, block, dtypes, seed, monkeypatch):
    """The interpreter runs a whole block per step (the one-pass branch); the GPU's default steps through
    the block in passes of STEP_ROWS rows (gather + amax, then gather + quantize). Forced here to 16 rows."""
    import functools

    from mtrain.kernels import triton_fp8

    monkeypatch.setattr(triton_fp8, "launch_fp8", functools.partial(triton_fp8.launch_fp8, step=16))
    rng = np.random.default_rng(seed)
    full, srcs, rows = random_layout(shape, rng, dtypes)
    q, s = run_fp8(shape, srcs, rows, "triton", block)
    rq, rs = ref_quant(full, block)
    assert torch.equal(bits(q), bits(rq)) and torch.equal(s, rs)
