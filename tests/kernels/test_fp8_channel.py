"""Per-channel FP8 (kernels/fp8_channel.py; the Triton kernel's CHANNEL path, TRITON_INTERPRET=1).

The reference is written here from the formula of SGLang's sm90 per-token kernel, in float64 where that is exact:
float32 denormals read as signed zeros, scale = float32(amax * float32(1/448)) (a product of two float32 values is
exact in float64, then rounded once), a scale below the smallest normal float32 is 0, inv = float32(1 / scale)
(the IEEE reciprocal: the CPU's stand-in for the GPU's rcp.approx), q = float32(x * inv) (exact in float64, rounded
once), clamped to +-448, then torch's cast to float8_e4m3fn; a zero scale gives signed zeros. The torch quantizer
and the scatter kernels (torch executor, Triton interpreter) must equal it bit for bit, values and scales.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mtrain.kernels import BlockFp8, PieceTableError, ScatterTable, execute_scatter
from mtrain.kernels.fp8_channel import (channel_block, channel_scale_shape, dequantize_channels,
                                        quantize_channels)

FP8 = torch.float8_e4m3fn
TINY = float(np.finfo(np.float32).tiny)


def ref_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, from the formula (module docstring)."""
    x = w.to(torch.float32).to(torch.float64)
    q = torch.empty(x.shape, dtype=FP8)
    s = torch.empty(x.shape[0], dtype=torch.float32)
    c = float(np.float32(1.0 / 448.0))
    for i in range(x.shape[0]):
        row = torch.where(x[i].abs() < TINY, x[i] * 0.0, x[i])
        amax = float(row.abs().max()) if row.numel() else 0.0
        scale = float(np.float32(amax * c))
        scale = 0.0 if scale < TINY else scale
        s[i] = scale
        if scale > 0:
            inv = float(np.float32(1.0 / scale))
            v = (row * inv).to(torch.float32).to(torch.float64).clamp(-448.0, 448.0)
        else:
            v = row * 0.0
        q[i] = v.to(torch.float32).to(FP8)
    return q, s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def special_rows(k: int, seed: int = 0) -> torch.Tensor:
    """Rows a real weight rarely has: all zeros, all -0.0, -0.0 mixed in, float32 denormals (bf16 keeps them),
    tiny rows whose scale is denormal, a huge value that saturates its row's neighbours' rounding, a row of one
    value, and ordinary rows over a wide range of magnitudes."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(k), torch.full((k,), -0.0)]
    r = torch.randn(k, generator=g)
    r[::3] = -0.0
    rows.append(r)
    rows.append(torch.where(torch.randn(k, generator=g) > 0, 1e-40, -1e-40))  # denormal: amax 0
    rows.append(torch.randn(k, generator=g) * 1e-37)  # normal values, denormal scale
    big = torch.randn(k, generator=g)
    big[k // 2] = 3e38
    rows.append(big)
    rows.append(torch.full((k,), 0.0123))
    for e in range(-8, 4):
        rows.append(torch.randn(k, generator=g) * 10.0 ** e)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_channels_equals_formula(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.cat([special_rows(96), torch.randn(40, 96, generator=g) * 0.02])
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    w = w.to(dtype)
    q, s = quantize_channels(w)
    rq, rs = ref_channels(w)
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    assert torch.equal(bits(q), bits(rq))
    # the scale is amax * float32(1/448), not the IEEE quotient amax / 448: they differ on some rows
    amax = w.float().abs().amax(1)
    assert (s != amax / torch.full_like(amax, 448.0)).any()
    # dequantized, every ordinary row is within e4m3's half-ulp of the source: 2**-4 relative for normal e4m3
    # values, half the subnormal step (2**-10 x scale) below them; the 1.01: the product's float32 roundings
    deq = dequantize_channels(q, s)
    ok = torch.arange(len(w)) >= 7
    bound = torch.maximum(w.float()[ok].abs() * 2.0 ** -4, s[ok, None] * 2.0 ** -10) * 1.01
    assert torch.all((deq[ok] - w.float()[ok]).abs() <= bound)


def test_zero_and_negative_zero_rows():
    w = special_rows(16).bfloat16()
    q, s = quantize_channels(w)
    assert s[0] == 0 and s[1] == 0 and s[3] == 0
    assert torch.all(bits(q[0]) == 0x00) and torch.all(bits(q[1]) == 0x80)
    assert torch.all(bits(q[3]) == torch.where(w[3].float() > 0, 0x00, 0x80).to(torch.uint8))
    neg0 = torch.signbit(w[2].float()) & (w[2].float() == 0)
    assert torch.all(bits(q[2])[neg0] == 0x80)
    assert int(bits(q[5])[8]) == 0x7E  # 448: the huge element (column k // 2) is the row's amax


def _scatter(w: torch.Tensor, rows, srcs, backend: str):
    n, k = w.shape
    dst = torch.empty(n * k, dtype=FP8)
    bits(dst).fill_(0x7F)  # NaN bytes: anything left unwritten shows
    scale = torch.full((n,), float("nan"))
    execute_scatter([dst], srcs, ScatterTable.from_rows(rows), backend=backend,
                    quant={0: BlockFp8(scale, (n, k), channel_block(k), scaling="channel")})
    return dst.view(n, k), scale


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("k", [576, 192, 7])
def test_scatter_fused_parts_equal_formula(backend, k):
    """A SmolLM2-like fused destination (q;k;v of different widths fed from separate bf16 sources at odd
    offsets, one a float32 source), plus the special rows: Triton (interpreted) == torch == the formula."""
    g = torch.Generator().manual_seed(k)
    parts = [special_rows(k, 2), torch.randn(24, k, generator=g) * 0.05, torch.randn(9, k, generator=g) * 3.0]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16]
    srcs, rows, r0 = [], [], 0
    for i, (p, dt) in enumerate(zip(parts, dtypes)):
        off = 3 + i
        buf = torch.zeros(off + p.numel() + 5, dtype=dt)
        buf[off:off + p.numel()] = p.reshape(-1).to(dt)
        srcs.append(buf)
        rows.append([i, off, k, r0 * k, k, p.shape[0], k, 0])
        r0 += p.shape[0]
    w = torch.cat([p.to(dt).float() for p, dt in zip(parts, dtypes)])
    q, s = _scatter(w, rows, srcs, backend)
    rq, rs = ref_channels(w)
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    assert torch.equal(bits(q), bits(rq))


def test_rows_from_two_column_shards_share_one_scale():
    """A row-parallel weight from training TP 2: each destination row gathers from two sources (column halves);
    its scale is the amax over both."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(33, 100, generator=g) * torch.logspace(-3, 1, 33)[:, None]).bfloat16()
    a, b = w[:, :37].contiguous(), w[:, 37:].contiguous()
    rows = [[0, 0, 37, 0, 100, 33, 37, 0], [1, 0, 63, 37, 100, 33, 63, 0]]
    rq, rs = ref_channels(w)
    for backend in ("triton", "torch"):
        q, s = _scatter(w, rows, [a.view(-1), b.view(-1)], backend)
        assert torch.equal(bits(q), bits(rq)) and torch.equal(s, rs), backend


def test_channel_spec_refusals():
    dst = torch.empty(12, dtype=FP8)
    src = torch.randn(12)
    rows = ScatterTable.from_rows([[0, 0, 12, 0, 12, 1, 12, 0]])
    for spec, what in ((BlockFp8(torch.zeros(3), (3, 4), (1, 2), scaling="channel"), r"block \(1, cols\)"),
                       (BlockFp8(torch.zeros(3), (1, 3, 4), (1, 4), scaling="channel"), "2-D"),
                       (BlockFp8(torch.zeros(3), (3, 4), (1, 4), scaling="tensor"), "scaling must be")):
        with pytest.raises(PieceTableError, match=what):
            execute_scatter([dst], [src], rows, backend="torch", quant={0: spec})
    assert channel_scale_shape((960, 576)) == (1, 960)
