"""Per-channel FP8 (one float32 scale per output row): what SGLang 0.5.17 makes of a bf16 linear weight when it
quantizes it itself (quantization="fp8", no serialized FP8 checkpoint, no block size: `Fp8LinearMethod.
process_weights_after_loading`, layers/quantization/fp8.py:826-860). On CUDA that is
`per_token_group_quant_fp8(w, K)` -> `sglang_per_token_quant_fp8` -> sgl_kernel's `sgl_per_token_quant_fp8`
(sglang-kernel 0.4.5, csrc/gemm/per_token_quant_fp8.cu), built for sm90 with -use_fast_math. Its machine code
(cuobjdump -sass of sgl_kernel/sm90/common_ops.abi3.so, both the sm_90 and sm_90a cubins) is, per row:
    amax  = FMNMX.FTZ over |x|                        (float32 denormal inputs count as 0)
    scale = FMUL.FTZ(amax, 0.0022321429569274187)     (float32(1/448), a multiply, not amax / 448; FTZ)
    inv   = MUFU.RCP(scale)                           (the hardware's approximate reciprocal, rcp.approx.ftz.f32)
    q     = F2FP.SATFINITE.E4M3(clamp(FMUL.FTZ(x, inv), -448, 448))   (round to nearest even)
and the engine keeps `weight = q.t()` (a [K, N] view of [N, K] storage) and `weight_scale = scale.t()` ([1, N]).
An all-zero row has scale 0: the warp kernel (rows >= 16 x the GPU's SMs) then takes inv = 0 and stores signed
zeros, the small-batch kernel takes inv = +inf and stores 0x7E (448) for every element; either dequantizes to 0.
This module and the Triton kernel store signed zeros (docs/fp8.md, "Per-channel FP8").
The reciprocal: the Triton kernel issues the same rcp.approx.ftz.f32 on the GPU; where there is no such instruction
(torch on the CPU, the Triton interpreter) it is the IEEE reciprocal (docs/fp8.md says where the two differ).
"""
from __future__ import annotations

import numpy as np
import torch

from .fp8_format import FP8, FP8_MAX

# float32(1 / 448): the constant SGLang's kernel multiplies amax by (the sm90 SASS immediate)
SCALE_MUL = float(np.float32(1.0 / FP8_MAX))
# the smallest normal float32: FTZ arithmetic reads and writes anything smaller as a (signed) zero
FTZ_MIN = float(np.finfo(np.float32).tiny)


def channel_block(cols: int) -> tuple[int, int]:
    """The scatter kernels' block for per-channel FP8 of a [rows, cols] weight: one row, every column."""
    return (1, int(cols))


def channel_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """SGLang's weight_scale shape for a per-channel FP8 weight of (storage) shape [N, K]: [1, N]."""
    if len(shape) != 2:
        raise ValueError(f"per-channel FP8 is for 2-D linear weights, got shape {tuple(shape)}")
    return (1, int(shape[0]))


def _ftz(x: torch.Tensor) -> torch.Tensor:
    """Flush float32 denormals to signed zero (x * 0 keeps the sign)."""
    return torch.where(x.abs() < FTZ_MIN, x * 0.0, x)


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantize w ([N, K], any float dtype) -> (float8_e4m3fn [N, K], float32 scale [N]); the reciprocal is
    the IEEE one (module docstring)."""
    x = _ftz(w.detach().to(torch.float32))
    amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else torch.zeros(*x.shape[:-1], 1, dtype=torch.float32,
                                                                              device=x.device)
    # a float32 tensor factor: the multiply is float32 x float32 on every device (a Python float would be too,
    # but the tensor states it)
    scale = amax * torch.full_like(amax, SCALE_MUL)
    scale = torch.where(scale < FTZ_MIN, torch.zeros_like(scale), scale)
    inv = torch.where(scale > 0, torch.ones_like(scale) / torch.where(scale > 0, scale, torch.ones_like(scale)),
                      torch.zeros_like(scale))
    q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.view(x.shape[:-1]).contiguous()


def dequantize_channels(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale per row, in float32 (what SGLang's per-channel GEMM computes with)."""
    return q.to(torch.float32) * scale.reshape(*q.shape[:-1], 1)
