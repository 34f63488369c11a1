"""Name the difference between two block-FP8 parameter states (GPU diagnostics of an FP8 sync; CPU-testable).

`benchmarks/gpu_fp8_sync.py` compares what an FP8 SGLang engine holds after our sync with what it holds after
loading the same weights as a DeepSeek-format FP8 checkpoint. When they differ, `diagnose` says how, by undoing
each transform that could be in between (SGLang's post-load processing, docs/fp8.md):
  layout      the scale (or weight) stored transposed, or column-major (strides), or packed (int32/uint8: UE8M0);
  ue8m0       scales rounded up to powers of two (DeepGEMM's requantization; weights requantized to match);
  fnuz        float8_e4m3fnuz (ROCm's normalisation: same bits read as half the value, scale doubled);
  scale_ulp   scales one or a few ulps apart: the two sides computed amax/448 differently (e.g. one as
              amax * float32(1/448): torch's CUDA division by a Python scalar); with the bf16 source it also
              says which side is the IEEE quotient and which the reciprocal product, and whether the weight
              difference is fully explained by the scale (each side == quantize(source, its own scale));
  values      anything else: how many elements differ and by how many e4m3 steps.
The float64 block quantization here (`quantize_f64`) is written independently of mtrain.kernels (numpy, float64,
e4m3 rounding done arithmetically) and is what the GPU script holds GPU quantizations to.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
RECIPROCAL = np.float32(1.0) / np.float32(FP8_MAX)  # what CUDA torch multiplies by for `x / 448.0`


# ---------------------------------------------------------------------------------------------------------------
# Independent float64 statement of DeepSeek's block quantization.

def e4m3_round_f64(v: np.ndarray) -> np.ndarray:
    """Round float64 values in [-448, 448] to the nearest float8_e4m3fn value (ties to even), in float64:
    3 mantissa bits, normal exponents -6..8, subnormal step 2**-9."""
    a = np.abs(v)
    e = np.frexp(a)[1].astype(np.float64) - 1.0  # exact floor(log2 a) for a > 0 (a = 0 gives step 2**-9: fine)
    step = np.exp2(np.maximum(e, -6.0) - 3.0)
    return np.copysign(np.round(a / step) * step, v)  # np.round: half to even


def block_amax_f64(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Per-block max |x| of a [..., N, K] float64 array (edge blocks: their real elements only)."""
    bn, bk = block
    *lead, n, k = x.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = np.zeros((*lead, nb * bn, kb * bk))
    pad[..., :n, :k] = np.abs(x)
    return pad.reshape(*lead, nb, bn, kb, bk).max(axis=(-3, -1))


def expand(s: np.ndarray, shape: tuple[int, ...], block: tuple[int, int]) -> np.ndarray:
    """A per-block array broadcast to the elements of a [..., N, K] tensor."""
    return np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :shape[-2], :shape[-1]]


def quantize_with_scale_f64(x: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """e4m3(clamp(float32(x / scale))) per block for given float32 scales (scale 0 -> signed zero)."""
    xs = x.detach().cpu().to(torch.float64).numpy()
    s = expand(scale.detach().cpu().to(torch.float64).numpy(), xs.shape, block)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s > 0, xs / np.where(s > 0, s, 1.0), xs * 0.0)
    # The format quantizes the float32 quotient (the float64 one rounded once to float32 is exactly it), then
    # rounds that to e4m3: two roundings, as every float32 implementation (ours, SGLang's, DeepSeek's) does.
    v = v.astype(np.float32).astype(np.float64)
    q = e4m3_round_f64(np.clip(v, -FP8_MAX, FP8_MAX))
    return torch.from_numpy(q).to(torch.float32).to(FP8)  # exact: q is an e4m3 value


def quantize_f64(x: torch.Tensor, block=(128, 128), reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn, float32 scale_inv) of a [..., N, K] tensor: scale = float32(amax / 448) (the IEEE float32
    quotient: float64 division rounded once to float32 is exact for it), or with reciprocal=True
    float32(amax) * float32(1/448) rounded to float32 (what `amax / 448.0` computes in CUDA torch)."""
    xs = x.detach().cpu().to(torch.float64).numpy()
    amax = block_amax_f64(xs, block).astype(np.float32)  # amax of float32-representable values is one
    if reciprocal:
        scale = (amax.astype(np.float64) * np.float64(RECIPROCAL)).astype(np.float32)
    else:
        scale = (amax.astype(np.float64) / FP8_MAX).astype(np.float32)
    s = torch.from_numpy(np.ascontiguousarray(scale))
    return quantize_with_scale_f64(x, s, block), s


class CudaScalarDivision(TorchDispatchMode):
    """Run torch code on the CPU with CUDA's division by a Python number: x * float32(1 / b) instead of x / b
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu: a CPU-scalar divisor becomes a reciprocal multiply).
    `rewritten` counts the divisions it changed."""

    def __init__(self):
        super().__init__()
        self.rewritten = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.div.Tensor and isinstance(args[1], (int, float)) and args[0].is_floating_point():
            self.rewritten += 1
            inv = torch.tensor(np.float32(1.0) / np.float32(args[1]), dtype=args[0].dtype)
            return torch.ops.aten.mul.Tensor(args[0], inv)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Diagnosis.

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, flat (any dtype, any shape: a bf16 norm of odd length, a 0-d k_scale)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float32 ulps (same-sign finite values; int64)."""
    ia = a.detach().cpu().contiguous().view(torch.int32).to(torch.int64)
    ib = b.detach().cpu().contiguous().view(torch.int32).to(torch.int64)
    return (ia - ib).abs()


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Signed-magnitude code distance between two float8_e4m3fn tensors (1 = neighbouring values)."""
    def ordinal(t):
        u = t.detach().cpu().contiguous().view(torch.uint8).to(torch.int64)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)
    return (ordinal(a) - ordinal(b)).abs()


def _is_pow2(s: torch.Tensor) -> bool:
    bits = s.detach().cpu().contiguous().view(torch.int32)
    return bool(((bits & 0x7FFFFF) == 0).all()) and bool((s > 0).all())


def _layout(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "stride": list(t.stride()),
            "contiguous": t.is_contiguous()}


def diagnose_scale(ref: torch.Tensor, got: torch.Tensor, src: torch.Tensor | None = None,
                   block=(128, 128)) -> dict[str, Any]:
    """How scale `got` differs from `ref` (both weight_scale_inv tensors); src: the bf16 weight they scale."""
    out: dict[str, Any] = {"ref": _layout(ref), "got": _layout(got)}
    if ref.dtype != got.dtype:
        out["kind"] = "layout: dtype (packed scales, e.g. UE8M0 for DeepGEMM)" if ref.dtype in (
            torch.int32, torch.uint8) or got.dtype in (torch.int32, torch.uint8) else "layout: dtype"
        return out
    if tuple(ref.shape) != tuple(got.shape):
        if ref.dim() >= 2 and tuple(ref.transpose(-1, -2).shape) == tuple(got.shape) and \
                same_bits(ref.transpose(-1, -2), got):
            out["kind"] = "layout: transposed"
        else:
            out["kind"] = "layout: shape (padded / TMA-aligned?)"
        return out
    if same_bits(ref, got):
        out["kind"] = "equal" if ref.stride() == got.stride() else "equal values, other strides (column-major?)"
        return out
    out["blocks_differ"] = int((ref.detach().cpu().view(torch.int32) != got.detach().cpu().view(torch.int32)).sum())
    out["blocks"] = ref.numel()
    if ref.dim() >= 2 and ref.shape[-1] == ref.shape[-2] and same_bits(ref.transpose(-1, -2).contiguous(), got):
        out["kind"] = "layout: transposed (square)"
        return out
    if _is_pow2(ref) and not _is_pow2(got):
        up = torch.exp2(torch.ceil(torch.log2(got.detach().cpu().to(torch.float64)))).to(torch.float32)
        out["kind"] = "ue8m0: ref scales are powers of two" + (" = 2^ceil(log2(got))" if same_bits(up, ref.cpu())
                                                               else "")
        return out
    if bool((ref.detach().cpu() == 2 * got.detach().cpu()).all()):
        out["kind"] = "fnuz: ref = 2 x got (e4m3fnuz normalisation)"
        return out
    ulps = ulp_distance(ref, got)
    out["max_ulps"] = int(ulps.max())
    if out["max_ulps"] <= 4:
        out["kind"] = "scale_ulp"
        if src is not None:
            ieee = quantize_f64(src, block)[1]
            recip = quantize_f64(src, block, reciprocal=True)[1]
            out["ref_is"] = _which(ref, ieee, recip)
            out["got_is"] = _which(got, ieee, recip)
        return out
    rel = ((ref.detach().cpu().double() - got.detach().cpu().double()).abs() /
           ref.detach().cpu().double().abs().clamp_min(1e-30))
    out["kind"] = "values"
    out["max_rel"] = float(rel.max())
    return out


def _which(s: torch.Tensor, ieee: torch.Tensor, recip: torch.Tensor) -> str:
    if same_bits(s.cpu(), ieee):
        return "amax/448 (IEEE)"
    if same_bits(s.cpu(), recip):
        return "amax*fl32(1/448) (reciprocal)"
    return "neither"


def diagnose_weight(ref: torch.Tensor, got: torch.Tensor, ref_scale: torch.Tensor | None = None,
                    got_scale: torch.Tensor | None = None, src: torch.Tensor | None = None,
                    block=(128, 128)) -> dict[str, Any]:
    """How FP8 weight `got` differs from `ref`; with the bf16 source and both scales, whether each side is
    exactly quantize(source, its own scale) (then the weight difference is the scale difference's doing)."""
    out: dict[str, Any] = {"ref": _layout(ref), "got": _layout(got)}
    if ref.dtype != got.dtype:
        out["kind"] = ("fnuz: ref is float8_e4m3fnuz" if "fnuz" in str(ref.dtype) else "layout: dtype")
        return out
    if tuple(ref.shape) != tuple(got.shape):
        out["kind"] = ("layout: transposed" if ref.dim() >= 2 and same_bits(ref.transpose(-1, -2).contiguous(), got)
                       else "layout: shape")
        return out
    if same_bits(ref, got):
        out["kind"] = "equal" if ref.stride() == got.stride() else "equal values, other strides"
        return out
    if ref.dim() >= 2 and ref.shape[-1] == ref.shape[-2] and same_bits(ref.transpose(-1, -2).contiguous(), got):
        out["kind"] = "layout: transposed (square)"
        return out
    steps = e4m3_steps(ref, got)
    out["elements_differ"] = int((steps > 0).sum())
    out["elements"] = ref.numel()
    out["max_e4m3_steps"] = int(steps.max())
    out["kind"] = "values"
    if src is not None and ref_scale is not None and got_scale is not None and ref_scale.shape == got_scale.shape:
        out["ref_is_quant_of_src_with_ref_scale"] = same_bits(quantize_with_scale_f64(src, ref_scale, block), ref)
        out["got_is_quant_of_src_with_got_scale"] = same_bits(quantize_with_scale_f64(src, got_scale, block), got)
        if out["ref_is_quant_of_src_with_ref_scale"] and out["got_is_quant_of_src_with_got_scale"]:
            out["kind"] = "follows_scale"
    return out


def diagnose_pair(name: str, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                  src: torch.Tensor | None = None, block=(128, 128), scale_suffix: str = "_scale_inv") -> dict:
    """Weight `name` and its scale, ref vs got: {"weight": ..., "scale": ..., "kind": summary}."""
    sname = name + scale_suffix
    s = diagnose_scale(ref[sname], got[sname], src, block) if sname in ref and sname in got else None
    w = diagnose_weight(ref[name], got[name], ref.get(sname), got.get(sname), src, block)
    kinds = [w["kind"]] + ([s["kind"]] if s else [])
    if all(k == "equal" for k in kinds):
        kind = "equal"
    elif s is not None and s["kind"] == "scale_ulp" and w["kind"] in ("follows_scale", "equal"):
        kind = f"scale_ulp (ref {s.get('ref_is', '?')}, ours {s.get('got_is', '?')}); weight follows the scale"
    else:
        kind = f"weight: {w['kind']}; scale: {s['kind'] if s else '-'}"
    return {"kind": kind, "weight": w, "scale": s}


def diagnose_plain(ref: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    """A non-FP8 parameter (bf16 norms, embedding, ...)."""
    if same_bits(ref, got):
        return {"kind": "equal"}
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return {"kind": "layout", "ref": _layout(ref), "got": _layout(got)}
    d = (ref.detach().cpu().double() - got.detach().cpu().double()).abs()
    return {"kind": "values", "elements_differ": int((d > 0).sum()), "max_abs": float(d.max())}
