"""Block-wise FP8 dequantisation of DeepSeek-V3-style checkpoints.

The DeepSeek-V3 release stores most linear weights as `X.weight` in float8_e4m3fn plus `X.weight_scale_inv`
in float32 of shape [ceil(rows/128), ceil(cols/128)]: element (i, j) of the real weight is
`weight[i, j] * weight_scale_inv[i // 128, j // 128]` (the name says "inverse" because the quantiser divided
by it). Edge blocks are partial when a dimension is not a multiple of 128. Norms, embeddings, the head, the
router and its bias are stored unquantised and pass through unchanged.

`dequantized_view` turns a name -> getter view of such a checkpoint into a view of plain tensors without the
`*_scale_inv` names, so the hf-to-mcore converter reads an FP8 release exactly like a bf16 one:

    ckpt = HFCheckpoint(path)
    getters = {n: (lambda n=n: ckpt.get(n)) for n in ckpt.names()}
    if is_fp8_checkpoint(getters):
        getters = dequantized_view(getters, block=weight_block_size(config))
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from .errors import CheckpointError, TensorMismatchError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

Getter = Callable[[], torch.Tensor]


def _blocks(block: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    b = (block, block) if isinstance(block, int) else tuple(block)
    if len(b) != 2 or any(not isinstance(x, int) or x < 1 for x in b):
        raise ValueError(f"FP8 block size must be a positive int or a pair of them, got {block!r}")
    return b  # type: ignore[return-value]


def weight_block_size(config: Mapping) -> tuple[int, int]:
    """The block size from a HF config.json's quantization_config (DeepSeek-V3: [128, 128])."""
    q = config.get("quantization_config") or {}
    return _blocks(q.get("weight_block_size", 128))


def is_fp8_checkpoint(names: Iterable[str]) -> bool:
    """True when the checkpoint carries block scales (any `*.weight_scale_inv` tensor)."""
    return any(n.endswith(SCALE_SUFFIX) for n in names)


def dequant_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = 128, *,
                          out_dtype: torch.dtype = torch.bfloat16, name: str = "weight") -> torch.Tensor:
    """weight[i, j] * scale_inv[i // br, j // bc], computed in float32 and returned as `out_dtype`.

    float32 holds every product exactly rounded once (an e4m3 value has 4 significant bits), which is what
    DeepSeek's own dequantisation kernel computes before storing bf16.
    """
    br, bc = _blocks(block)
    if weight.dim() != 2:
        raise TensorMismatchError(f"{name}: an FP8 block-scaled weight must be 2-D, got shape {tuple(weight.shape)}")
    if weight.dtype not in FP8_DTYPES:
        raise TensorMismatchError(f"{name}: expected a float8 weight, got {weight.dtype}")
    if not scale_inv.is_floating_point() or scale_inv.dtype in FP8_DTYPES:
        raise TensorMismatchError(f"{name}{SCALE_SUFFIX}: expected float32 scales, got {scale_inv.dtype}")
    rows, cols = weight.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise TensorMismatchError(
            f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)} does not match weight {name} of shape "
            f"{(rows, cols)} with {br}x{bc} blocks (expected {want})")
    # Expand the scales over their blocks and crop the partial edge blocks; one float32 temporary.
    s = scale_inv.to(torch.float32).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.to(torch.float32) * s).to(out_dtype)


def dequantized_view(getters: Mapping[str, Getter], *, block: int | tuple[int, int] = 128,
                     out_dtype: torch.dtype = torch.bfloat16) -> dict[str, Getter]:
    """name -> getter of plain tensors: FP8 weights dequantised, `*_scale_inv` names dropped.

    Pairing is checked up front from the names (a scale whose weight is missing is an error); a float8
    weight without a scale is an error when it is read. Unquantised tensors are returned as stored.
    """
    block = _blocks(block)
    scales = {n[: -len(SCALE_SUFFIX)]: n for n in getters if n.endswith(SCALE_SUFFIX)}
    orphans = sorted(s for w, s in scales.items() if w not in getters)
    if orphans:
        raise CheckpointError(f"{orphans[0]}: block scales without a weight named {orphans[0][: -len(SCALE_SUFFIX)]}"
                              + (f" (and {len(orphans) - 1} more)" if len(orphans) > 1 else ""))
    out: dict[str, Getter] = {}
    for name, get in getters.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if name in scales:
            out[name] = _dequant_getter(name, get, getters[scales[name]], block, out_dtype)
        else:
            out[name] = _plain_getter(name, get)
    return out


def check_fp8_headers(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
                      block: int | tuple[int, int] = 128) -> int:
    """Every FP8 pairing checked from the headers alone, before any tensor is read or any rank starts: each
    `*_scale_inv` has its weight, is float32-like and has the shape the block size implies; each float8 weight
    has its scales. Returns the number of block-scaled weights."""
    br, bc = _blocks(block)
    scaled = 0
    for name, shape in shapes.items():
        if name.endswith(SCALE_SUFFIX):
            w = name[: -len(SCALE_SUFFIX)]
            if w not in shapes:
                raise CheckpointError(f"{name}: block scales without a weight named {w}")
            if not dtypes[name].is_floating_point or dtypes[name] in FP8_DTYPES:
                raise TensorMismatchError(f"{name}: expected float32 scales, got {dtypes[name]}")
            ws = shapes[w]
            if len(ws) != 2:
                raise TensorMismatchError(f"{w}: an FP8 block-scaled weight must be 2-D, got shape {tuple(ws)}")
            want = (-(-ws[0] // br), -(-ws[1] // bc))
            if tuple(shape) != want:
                raise TensorMismatchError(f"{name}: shape {tuple(shape)} does not match weight {w} of shape "
                                          f"{tuple(ws)} with {br}x{bc} blocks (expected {want})")
            scaled += 1
        elif dtypes[name] in FP8_DTYPES and name + SCALE_SUFFIX not in shapes:
            raise CheckpointError(f"{name}: float8 weight without {name}{SCALE_SUFFIX}: cannot dequantise it")
    return scaled


def _dequant_getter(name: str, get_w: Getter, get_s: Getter, block, out_dtype) -> Getter:
    def get() -> torch.Tensor:
        return dequant_fp8_blockwise(get_w(), get_s(), block, out_dtype=out_dtype, name=name)
    return get


def _plain_getter(name: str, get_w: Getter) -> Getter:
    def get() -> torch.Tensor:
        t = get_w()
        if t.dtype in FP8_DTYPES:
            raise CheckpointError(f"{name}: float8 weight without {name}{SCALE_SUFFIX}: cannot dequantise it")
        return t
    return get
