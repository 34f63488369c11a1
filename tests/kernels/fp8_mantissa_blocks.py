"""Block-FP8 weights that hold every (element mantissa, block amax mantissa) pair of a 16-bit source dtype, and
the check that the Triton kernel quantizes them exactly as the float64 reference does.

Why every mantissa pair is enough: the kernel divides by the block's scale through its reciprocal and one exact
correction (kernels/triton_fp8.py `_quotient`, RCP_DIV). Each step of that (reciprocal, product, remainder,
corrected quotient) only shifts by a power of two when an operand does, as long as nothing leaves the normal
float32 range, and the scale = float32(amax / 448) depends only on amax's mantissa. So for one amax exponent,
every amax mantissa (a block each) against every element mantissa at every exponent step below amax (quotients
from 448 down past e4m3's smallest value, both signs) covers every case the kernel meets with in-range scales.
Blocks at the ends of the exponent range check the scale-range test and the division fallback (scale outside
[2**-100, 2**100], or float32-subnormal).

Run as a script on a GPU (TRITON_INTERPRET=0; tests/kernels/test_fp8_rcp_div.py does) it checks the compiled
kernel on every pair of bf16 and of fp16; the CPU tests run the interpreter on a part (the rest: MTRAIN_SLOW=1).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

BLOCK = 128
MANT_BITS = {torch.bfloat16: 7, torch.float16: 10}
# amax exponents: the middle of the range, and the ends of the scale range the reciprocal path accepts
# (scale = amax / 448 is about amax * 2**-8.81: amax 2**-91 gives scale 2**-99.8, amax 2**108 gives 2**99.2)
IN_RANGE = {torch.bfloat16: (0, -91, 108), torch.float16: (4,)}
# scales outside it: float32-subnormal (-126), below 2**-100 (-93), above 2**100 (110, 127); fp16 has no such amax
FALLBACK = {torch.bfloat16: (-126, -93, 110, 127), torch.float16: ()}
STEPS = {torch.bfloat16: 26, torch.float16: 20}  # exponent steps below amax: quotients down to < 2**-10


def block_values(dtype: torch.dtype, amax: float) -> np.ndarray:
    """Every element mantissa at every exponent step at or below amax's, both signs, |x| <= amax (float64)."""
    m = MANT_BITS[dtype]
    e = np.floor(np.log2(amax))
    mant = 1.0 + np.arange(2 ** m) / 2 ** m
    vals = np.concatenate([mant * 2.0 ** (e - j) for j in range(STEPS[dtype])])
    vals = vals[vals <= amax]
    return np.concatenate([vals, -vals])


def build(dtype: torch.dtype, amax_every: int = 1, exponents: tuple | None = None,
          fallback_every: int = 16) -> tuple[torch.Tensor, int]:
    """A [n_blocks * 128, 128] weight of `dtype`: for each amax (every `amax_every`-th mantissa at each in-range
    exponent, every `fallback_every`-th at the fallback exponents) as many blocks as its values need, each holding
    amax itself, a share of block_values and zeros (one -0.0). Returns (weight, how many blocks)."""
    m = MANT_BITS[dtype]
    per_block = BLOCK * BLOCK - 2  # room for amax and one -0.0
    blocks = []
    plan = [(e, amax_every) for e in (exponents or IN_RANGE[dtype])] + [(e, fallback_every) for e in FALLBACK[dtype]]
    for e, every in plan:
        for k in range(0, 2 ** m, every):
            amax = (1.0 + k / 2 ** m) * 2.0 ** e
            vals = block_values(dtype, amax)
            for i in range(0, len(vals), per_block):
                b = np.zeros(BLOCK * BLOCK)
                chunk = vals[i:i + per_block]
                b[0], b[2:2 + len(chunk)] = amax, chunk
                b[1] = -0.0
                blocks.append(b)
    w = torch.from_numpy(np.concatenate(blocks)).to(dtype)  # exact, but for the smallest bf16 / fp16 subnormals
    return w.view(len(blocks) * BLOCK, BLOCK), len(blocks)


def quantize_with_kernel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """execute_scatter's Triton backend on one piece covering the weight: (fp8 weight, float32 scales)."""
    from mtrain.kernels import BlockFp8, ScatterTable, execute_scatter
    from mtrain.kernels.fp8 import FP8, scale_shape

    n, k = w.shape
    dst = torch.empty(n * k, dtype=FP8, device=w.device)
    dst.view(torch.uint8).fill_(0x7F)  # NaN bytes: anything left unwritten shows
    scale = torch.full((int(np.prod(scale_shape((n, k)))),), float("nan"), device=w.device)
    rows = [[0, 0, k, 0, k, n, k, 0]]
    execute_scatter([dst], [w.reshape(-1)], ScatterTable.from_rows(rows), backend="triton",
                    quant={0: BlockFp8(scale, (n, k))})
    return dst.view(n, k), scale.view(scale_shape((n, k)))


def mismatches(w: torch.Tensor, explain: int = 0) -> tuple[int, int]:
    """(elements, scales) where the kernel differs from fp8_diagnose.quantize_f64 (independent float64); with
    `explain`, prints that many differing elements (block, x, amax, scale, float32 quotient, both bytes)."""
    from mtrain.rollout.fp8_diagnose import quantize_f64

    q, s = quantize_with_kernel(w)
    rq, rs = quantize_f64(w.cpu())
    qb, rb = q.cpu().view(torch.uint8), rq.view(torch.uint8)
    bad = (qb != rb).nonzero().tolist()
    for r, c in bad[:explain]:
        x = float(w[r, c])
        sc = float(rs[r // BLOCK, c // BLOCK])
        quo = np.float32(np.float64(x) / np.float64(sc)) if sc > 0 else 0.0
        print(f"  block {r // BLOCK} ({r},{c}): x={x!r} amax={float(w[r // BLOCK * BLOCK:][:BLOCK].abs().max())!r} "
              f"scale={sc!r} x/scale={float(quo)!r} kernel 0x{int(qb[r, c]):02x} ({float(q[r, c].float())!r}) "
              f"reference 0x{int(rb[r, c]):02x} ({float(rq[r, c].float())!r})")
    bad_s = int((s.cpu().view(torch.int32) != rs.view(torch.int32)).sum())
    return len(bad), bad_s


def cvt_probe() -> int:
    """The GPU's saturating e4m3 conversion (triton_fp8._e4m3x4) against clamp-then-cast on values around and above
    448 and at e4m3 midpoints: how many differ (printed)."""
    import triton
    import triton.language as tl

    from mtrain.kernels.triton_fp8 import _e4m3x4

    @triton.jit
    def probe(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, _e4m3x4(tl.load(x_ptr + i)))

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    big = torch.tensor([448.0, 448.5, 455.0, 463.99, 464.0, 464.01, 479.0, 480.0, 500.0, 1e6, 3e38, float("inf")])
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9)), big, -big])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).cuda()
    y = torch.empty(n, dtype=torch.uint8, device="cuda")
    probe[(1,)](x, y, N=n)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (y != want).nonzero().flatten().tolist()
    for i in bad[:12]:
        print(f"  cvt {float(x[i])!r}: 0x{int(y[i]):02x}, clamp+cast 0x{int(want[i]):02x}")
    print(f"cvt probe: {len(bad)} of {x.numel()} values differ from clamp-then-cast")
    return len(bad)


def main() -> int:
    """Every pair of bf16 and of fp16 on the GPU (compiled kernel)."""
    from mtrain.kernels import triton_fp8 as tf

    ok = cvt_probe() == 0 if tf.HW_CVT else True
    for dtype in (torch.bfloat16, torch.float16):
        w, n = build(dtype, fallback_every=1)
        bad_q, bad_s = mismatches(w.cuda(), explain=12)
        print(f"{dtype}: {n} blocks, {w.numel()} elements (RCP_DIV={tf.RCP_DIV}, HW_CVT={tf.HW_CVT}, "
              f"PIPELINE={tf.PIPELINE}): "
              f"{bad_q} weight bytes and {bad_s} scales differ from the float64 reference")
        ok &= bad_q == 0 and bad_s == 0
    if ok:
        print("all blocks equal")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
