"""Block-FP8 math that does not depend on the device, and the GPU diagnosis of FP8 differences.

The H200 run of 2026-11-30 found every FP8 weight and scale of our sync different from SGLang's load of the
"same" checkpoint: the checkpoint had been quantized on the GPU by `quantize_blocks`, whose `amax / 448.0`
CUDA torch computes as amax * float32(1/448) (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu: a CPU-scalar
divisor becomes a reciprocal multiply), one ulp off the IEEE quotient for about half of all blocks; our kernel
uses the IEEE quotient (div_rn). On this CPU box the CUDA behaviour is emulated by a dispatch mode that rewrites
every division by a Python scalar the same way; the reference is `fp8_diagnose.quantize_f64` (numpy, float64,
e4m3 rounding done arithmetically), itself checked against torch's cast on every e4m3 value and midpoint.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mtrain.kernels import quantize_blocks
from mtrain.rollout import fp8_diagnose as D
from mtrain.rollout.fp8_diagnose import CudaScalarDivision

FP8 = torch.float8_e4m3fn


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_e4m3_round_f64_equals_torch_cast_on_every_value_and_midpoint():
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float64)
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, vals * (1 + 2.0 ** -20), vals * (1 - 2.0 ** -20)]).clamp(-448, 448)
    x = x.to(torch.float32).to(torch.float64)  # float32 inputs: torch's cast rounds once from there
    ours = torch.from_numpy(D.e4m3_round_f64(x.numpy())).to(torch.float32).to(FP8)
    assert torch.equal(u8(ours), u8(x.to(torch.float32).to(FP8)))


@pytest.mark.parametrize("shape", [(300, 260), (2, 257, 130), (128, 128), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_blocks_is_the_ieee_quotient_even_with_cuda_scalar_division(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * 0.03).to(dtype)
    w.view(-1)[0] = 0.0
    ref_q, ref_s = D.quantize_f64(w)
    with CudaScalarDivision():
        q, s = quantize_blocks(w)
    assert torch.equal(s, ref_s) and torch.equal(u8(q), u8(ref_q))
    q2, s2 = quantize_blocks(w)  # and plainly
    assert torch.equal(s2, ref_s) and torch.equal(u8(q2), u8(ref_q))


def test_the_emulation_bites_a_scalar_divisor():
    """The mode really changes `x / 448.0` (else the test above proves nothing): about half the scales move."""
    amax = torch.rand(4096) * 0.1 + 1e-3
    with CudaScalarDivision() as mode:
        recip = amax / 448.0
    assert mode.rewritten == 1
    ieee = torch.from_numpy((amax.double().numpy() / 448.0).astype(np.float32))
    frac = float((recip != ieee).float().mean())
    assert 0.2 < frac < 0.8
    assert int(D.ulp_distance(recip, ieee).max()) == 1
    f64_recip = D.quantize_f64(amax.view(1, -1), (1, 1), reciprocal=True)[1].view(-1)
    assert torch.equal(f64_recip, recip)


# ---------------------------------------------------------------------------------------------------------------
# diagnose: each candidate transform, written here independently, is named.

def _case(seed=0, shape=(384, 256)):
    g = torch.Generator().manual_seed(seed)
    src = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    q, s = D.quantize_f64(src)
    return src, {"w": q, "w_scale_inv": s}


def test_diagnose_equal():
    src, got = _case()
    r = D.diagnose_pair("w", dict(got), got, src)
    assert r["kind"] == "equal"


def test_diagnose_reciprocal_scales_and_weights_that_follow_them():
    src, got = _case(1)
    q, s = D.quantize_f64(src, reciprocal=True)
    r = D.diagnose_pair("w", {"w": q, "w_scale_inv": s}, got, src)
    assert r["scale"]["kind"] == "scale_ulp" and r["scale"]["max_ulps"] == 1
    assert r["scale"]["ref_is"].startswith("amax*fl32(1/448)") and r["scale"]["got_is"] == "amax/448 (IEEE)"
    assert r["weight"]["kind"] in ("follows_scale", "equal")
    assert r["kind"].startswith("scale_ulp")


def test_diagnose_ue8m0_requantization():
    src, got = _case(2)
    s = got["w_scale_inv"]
    up = torch.from_numpy(np.exp2(np.ceil(np.log2(s.double().numpy()))).astype(np.float32))
    r = D.diagnose_pair("w", {"w": D.quantize_with_scale_f64(src, up), "w_scale_inv": up}, got, src)
    assert r["scale"]["kind"].startswith("ue8m0") and "2^ceil" in r["scale"]["kind"]


def test_diagnose_layouts():
    src, got = _case(3)
    s = got["w_scale_inv"]  # 3 x 2: not square
    assert D.diagnose_scale(s.t().contiguous(), s)["kind"] == "layout: transposed"
    assert D.diagnose_scale(s.t().contiguous().t(), s)["kind"] == "equal values, other strides (column-major?)"
    assert D.diagnose_scale(s.view(torch.int32), s)["kind"].startswith("layout: dtype (packed")
    assert D.diagnose_scale(torch.zeros(4, 2), s)["kind"].startswith("layout: shape")
    assert D.diagnose_scale(2 * s, s)["kind"].startswith("fnuz")
    w = got["w"]
    assert D.diagnose_weight(w.t().contiguous(), w)["kind"] == "layout: transposed"
    sq = _case(4, (256, 256))[1]["w"]
    assert D.diagnose_weight(sq.t().contiguous(), sq)["kind"] == "layout: transposed (square)"


def test_diagnose_other_values():
    src, got = _case(5)
    bad = got["w"].clone()
    bad.view(torch.uint8)[7, :5] ^= 0x02
    r = D.diagnose_pair("w", {"w": bad, "w_scale_inv": got["w_scale_inv"]}, got, src)
    assert r["weight"]["kind"] == "values" and r["weight"]["elements_differ"] == 5
    assert r["scale"]["kind"] == "equal"
    far = D.diagnose_scale(got["w_scale_inv"] * 1.5, got["w_scale_inv"])
    assert far["kind"] == "values" and far["max_rel"] > 0.3
    assert D.diagnose_plain(src, src.clone())["kind"] == "equal"
    assert D.diagnose_plain(src, src + 1)["kind"] == "values"


def test_the_release_writers_quantiser_is_the_ieee_quotient_under_cuda_division():
    """make-fp8's quantiser (converters/fp8_release.py) had the same scalar division; non-zero blocks agree."""
    from mtrain.converters.fp8_release import quantize_fp8_blockwise

    w = (torch.randn(300, 260, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    with CudaScalarDivision():
        q, s = quantize_fp8_blockwise(w)
    ref_q, ref_s = D.quantize_f64(w)
    assert torch.equal(s, ref_s) and torch.equal(u8(q), u8(ref_q))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantize_blocks_on_cuda_equals_float64():
    w = (torch.randn(2, 513, 700, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    q, s = quantize_blocks(w.cuda())
    ref_q, ref_s = D.quantize_f64(w)
    assert torch.equal(s.cpu(), ref_s) and torch.equal(u8(q.cpu()), u8(ref_q))


def test_diagnose_plain_takes_any_shape_and_dtype():
    odd = torch.randn(7).to(torch.bfloat16)
    assert D.diagnose_plain(odd, odd.clone())["kind"] == "equal"
    assert D.diagnose_plain(torch.tensor(1.0), torch.tensor(2.0))["kind"] == "values"
    f8 = torch.randn(3, 3).to(FP8)
    assert D.diagnose_plain(f8, torch.zeros(3, 3).to(FP8))["kind"] == "values"
